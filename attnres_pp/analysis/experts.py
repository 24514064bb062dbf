"""The expert loads of an MoE run (docs/spec.md section 12), as `attnres-pp analyze` shows them beside
the depth routing: read from the run's folder, not from its checkpoint, since the loads are what
training routed.

- summary.json `moe_expert_loads` {layer: [tokens per expert]}: the last step's token-choices per
  routed expert of every MoE layer (a token counts once at each of its K experts);
- metrics.jsonl `moe_load_max_over_mean/<layer>` per step (the busiest expert over the mean one:
  1 is perfect balance, E / K means every token chose the same K experts) and, under aux-loss
  balancing, `moe_aux_loss`.

`expert_loads(run_dir)` gathers them; `experts_figure` draws three panels: the depth-routing heatmap
(where the run has depth attention), the last step's load per layer and expert relative to the mean
(with each layer's max / mean), and max / mean per layer over the steps with the aux loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attnres_pp.analysis.figures import weight_matrices  # noqa: E402

MAX_OVER_MEAN = "moe_load_max_over_mean"


@dataclass(frozen=True)
class ExpertLoads:
    """A run's expert loads: `layers` the MoE layers in order, `tokens_LE` the last step's tokens per
    expert (one row per layer, NaN where summary.json has none), `steps` the steps of metrics.jsonl
    that carry loads, `max_over_mean_LS` per layer and step, `aux_loss` per step (None without)."""

    layers: list[int]
    tokens_LE: np.ndarray
    steps: list[int]
    max_over_mean_LS: np.ndarray
    aux_loss: list[float] | None

    @property
    def relative_LE(self) -> np.ndarray:
        """Tokens per expert over the layer's mean: 1 everywhere is perfect balance."""
        return self.tokens_LE / self.tokens_LE.mean(axis=1, keepdims=True)

    def to_json(self) -> dict:
        return {"layers": self.layers, "last_step_tokens_per_expert": self.tokens_LE.tolist(),
                "last_step_max_over_mean": self.relative_LE.max(axis=1).tolist(), "steps": self.steps,
                "max_over_mean": {str(layer): row.tolist() for layer, row in zip(self.layers, self.max_over_mean_LS,
                                                                                 strict=True)},
                "aux_loss": self.aux_loss}


def expert_loads(run_dir: str | Path) -> ExpertLoads | None:
    """The loads of the run in `run_dir`, or None when its metrics.jsonl has none (a dense model);
    ValueError when the run has no metrics.jsonl."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"RUN {run_dir} has no metrics.jsonl: give the --out directory of a training run")
    records = [r for r in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
               if MAX_OVER_MEAN in r]
    if not records:
        return None
    prefix = MAX_OVER_MEAN + "/"
    layers = sorted({int(key[len(prefix):]) for r in records for key in r if key.startswith(prefix)})
    summary_path = run_dir / "summary.json"
    loads = json.loads(summary_path.read_text()).get("moe_expert_loads", {}) if summary_path.is_file() else {}
    n_experts = max((len(v) for v in loads.values()), default=1)
    tokens_LE = np.array([loads.get(str(layer), [np.nan] * n_experts) for layer in layers], dtype=float)
    max_over_mean_LS = np.array([[r.get(f"{prefix}{layer}", np.nan) for r in records] for layer in layers])
    aux = [r.get("moe_aux_loss", np.nan) for r in records]
    return ExpertLoads(layers=layers, tokens_LE=tokens_LE, steps=[r["step"] for r in records],
                       max_over_mean_LS=max_over_mean_LS,
                       aux_loss=aux if any("moe_aux_loss" in r for r in records) else None)


def experts_figure(loads: ExpertLoads, routing_sites: list[dict] | None, title: str, n_streams: int = 1):
    """The figure (matplotlib Figure): [depth routing |] load per layer and expert | max / mean over
    steps. `routing_sites`: `RoutingProbe.summary` rows of a depth-attention run (`n_streams` per
    site under MSAR), else None."""
    panels = 3 if routing_sites else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels, 1.8 + 0.3 * max(len(loads.layers), 6)), squeeze=False,
                             layout="constrained")
    axes = list(axes[0])
    if routing_sites:
        _routing_panel(axes.pop(0), routing_sites, n_streams)
    load_ax, steps_ax = axes
    relative_LE = loads.relative_LE
    image = load_ax.imshow(np.ma.masked_invalid(relative_LE), cmap="magma", vmin=0.0,
                           vmax=max(2.0, float(np.nanmax(relative_LE)) if np.isfinite(relative_LE).any() else 2.0),
                           aspect="auto")
    load_ax.set_yticks(range(len(loads.layers)),
                       [f"layer {layer}  ({row.max():.2f})" for layer, row in zip(loads.layers, relative_LE,
                                                                                  strict=True)], fontsize=7)
    load_ax.set_xticks(range(relative_LE.shape[1]))
    if relative_LE.shape[1] <= 16 and len(loads.layers) <= 32:  # the counts themselves, where they fit
        for (i, e), tokens in np.ndenumerate(loads.tokens_LE):
            if np.isfinite(tokens):
                load_ax.text(e, i, f"{tokens:.0f}", ha="center", va="center", fontsize=6,
                             color="white" if relative_LE[i, e] < 1.0 else "black")
    load_ax.set_xlabel("routed expert")
    load_ax.set_title("last step: tokens per expert / mean\n(max / mean per layer in brackets)", fontsize=9)
    fig.colorbar(image, ax=load_ax, label="load / mean (1 = balanced)")
    colors = plt.cm.viridis(np.linspace(0.0, 0.9, len(loads.layers)))  # one colour per layer, by depth
    for layer, row, color in zip(loads.layers, loads.max_over_mean_LS, colors, strict=True):
        steps_ax.plot(loads.steps, row, lw=1, color=color, label=f"layer {layer}")
    steps_ax.axhline(1.0, color="grey", ls=":", lw=1)
    steps_ax.set_xlabel("step")
    steps_ax.xaxis.get_major_locator().set_params(integer=True)
    steps_ax.set_ylabel("max / mean tokens per expert")
    steps_ax.set_title("balance over training", fontsize=9)
    steps_ax.legend(fontsize=6, ncol=2)
    if loads.aux_loss is not None:
        twin = steps_ax.twinx()
        twin.plot(loads.steps, loads.aux_loss, "k--", lw=1, label="aux loss")
        twin.set_ylabel("aux loss (dashed)")
    fig.suptitle(title, fontsize=10)
    return fig


def _routing_panel(ax, sites: list[dict], n_streams: int) -> None:
    """The depth-routing heatmap of `figures.heatmap_png` (stream 0 under MSAR), sites by layer."""
    matrices, columns = weight_matrices(sites, n_streams)
    routed = [r for r in sites if "weights" in r]
    ax.imshow(np.ma.masked_invalid(matrices[0]), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(columns)), columns, fontsize=7)
    ax.set_yticks(range(len(routed)), ["final" if r["kind"] == "final" else f"{r['layer']}.{r['kind']}"
                                       for r in routed], fontsize=6)
    ax.set_xlabel("source (b0 = embedding, bj = block j, p = open partial)")
    ax.set_title("depth routing: mean weight per source" + (" (stream 0)" if n_streams > 1 else ""), fontsize=9)


def experts_png(loads: ExpertLoads, routing_sites: list[dict] | None, path: Path, title: str,
                n_streams: int = 1) -> Path:
    fig = experts_figure(loads, routing_sites, title, n_streams)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
