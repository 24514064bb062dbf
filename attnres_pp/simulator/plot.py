"""PNG figures: pipeline timelines (simulated or measured) and sweep line plots.

matplotlib is imported inside the functions, with the Agg backend, so importing the simulator
stays fast and needs no display. A timeline takes plain events (rank, name, start_s, end_s,
category), the same input as `trace.write_chrome_trace`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from attnres_pp.schedule.ir import Action, ActionKind

# Above this many compute boxes, microbatch labels would be unreadable.
_MAX_LABELLED_BOXES = 600
# Forward boxes light, backward boxes dark, in the colour of the chunk's virtual stage.
_FORWARD_ALPHA, _BACKWARD_ALPHA = 0.45, 0.95


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(events: Iterable[tuple[int, str, float, float, str]], path: str | Path, *,
                  n_stages: int | None = None, title: str = "", time_unit: str = "s") -> Path:
    """One row per rank (rank 0 on top); F light and B dark, hue by virtual stage; idle is blank.

    Events whose name is not an F/B action string (communication, other spans) are not drawn.
    Time starts at the earliest event, so measured wall-clock timestamps plot like simulated ones.
    """
    plt = _pyplot()
    compute = []
    for rank, name, start_s, end_s, _category in events:
        try:
            action = Action.parse(name)
        except ValueError:
            continue
        if action.is_compute:
            compute.append((rank, action, start_s, end_s))
    t_zero = min((start_s for _, _, start_s, _ in compute), default=0.0)
    boxes: dict[tuple[int, int, bool], list[tuple[float, float]]] = {}
    labels: list[tuple[int, float, float, str]] = []
    max_rank, max_chunk, t_end = 0, 0, 0.0
    for rank, action, start_s, end_s in compute:
        start_s, end_s = start_s - t_zero, end_s - t_zero
        is_forward = action.kind is ActionKind.F
        boxes.setdefault((rank, action.chunk_index, is_forward), []).append((start_s, end_s - start_s))
        labels.append((rank, start_s, end_s, str(action.microbatch_index)))
        max_rank, max_chunk, t_end = max(max_rank, rank), max(max_chunk, action.chunk_index), max(t_end, end_s)
    n_stages = n_stages or max_rank + 1
    n_virtual = max(1, -(-(max_chunk + 1) // n_stages))
    cmap = plt.get_cmap("tab10")
    height = min(12.0, 1.0 + 0.35 * n_stages)
    fig, ax = plt.subplots(figsize=(12, height))
    for (rank, chunk_index, is_forward), spans in boxes.items():
        colour = cmap((chunk_index // n_stages) % 10)
        alpha = _FORWARD_ALPHA if is_forward else _BACKWARD_ALPHA
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour, alpha=alpha,
                       edgecolor="black" if len(labels) <= _MAX_LABELLED_BOXES else "none", linewidth=0.3)
    if len(labels) <= _MAX_LABELLED_BOXES:
        for rank, start_s, end_s, text in labels:
            ax.text((start_s + end_s) / 2, rank, text, ha="center", va="center", fontsize=6)
    ax.set_ylim(n_stages - 0.5, -0.5)
    ax.set_xlim(0, t_end * 1.01 if t_end else 1)
    ax.set_yticks(range(n_stages))
    ax.set_yticklabels([f"rank {r}" for r in range(n_stages)], fontsize=7 if n_stages > 16 else 9)
    ax.set_xlabel(f"time ({time_unit})")
    handles, names = [], []
    for v in range(n_virtual):
        for kind, alpha in (("F", _FORWARD_ALPHA), ("B", _BACKWARD_ALPHA)):
            handles.append(plt.Rectangle((0, 0), 1, 1, color=cmap(v % 10), alpha=alpha))
            names.append(f"{kind} v{v}")
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7,
              ncol=1 + len(names) // 24, frameon=False)
    ax.set_title(title or "pipeline timeline (F light, B dark, labels = microbatch)")
    return _save(fig, plt, path)


def plot_lines(path: str | Path, *, x: Sequence[float], series: dict[str, Sequence[float]], title: str,
               xlabel: str, ylabel: str, log_x: bool = False, log_y: bool = False) -> Path:
    """A line plot with one line per series (sweep figures)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # Varying line style and marker keep coinciding series (gpipe and 1f1b bubbles) visible.
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    for index, (label, values) in enumerate(series.items()):
        linestyle, marker = styles[index % len(styles)]
        ax.plot(list(x), list(values), linestyle=linestyle, marker=marker, label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels([str(v) for v in x])
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
