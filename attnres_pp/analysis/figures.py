"""The PNGs of `attnres-pp analyze`, drawn from the per-site rows of `model.routing.RoutingProbe.summary`:
the sites x sources heatmap of mean depth-attention weights (one panel per stream under MSAR), routing
entropy and top-1 mass per site, the dilution curve (per-sublayer input and output RMS, against a
standard-residual baseline when given) and MSAR's gate means per stream."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _site_label(row: dict) -> str:
    return "final" if row["kind"] == "final" else f"{row['layer']}.{row['kind']}"


def weight_matrices(rows: list[dict], n_streams: int) -> tuple[list[np.ndarray], list[str]]:
    """Per stream a [sites, blocks + 1] matrix: columns b_0 .. b_N, then the open partial ("p"); NaN
    where a site does not read that source."""
    routed = [r for r in rows if "weights" in r]
    n_blocks = max(sum(1 for s in r["sources"] if s.startswith("b")) for r in routed)
    columns = [f"b{j}" for j in range(n_blocks)] + ["p"]
    matrices = []
    for stream in range(n_streams):
        matrix = np.full((len(routed), len(columns)), np.nan)
        for i, row in enumerate(routed):
            weights = row["weights"][stream] if n_streams > 1 else row["weights"]
            for name, w in zip(row["sources"], weights, strict=True):
                matrix[i, columns.index("p" if name.startswith("p") else name)] = w
        matrices.append(matrix)
    return matrices, columns


def heatmap_png(rows: list[dict], n_streams: int, path: Path, title: str) -> Path:
    matrices, columns = weight_matrices(rows, n_streams)
    routed = [r for r in rows if "weights" in r]
    fig, axes = plt.subplots(1, n_streams, figsize=(1.2 + 0.45 * len(columns) * n_streams + 1.5 * n_streams,
                                                     1.5 + 0.28 * len(routed)), squeeze=False)
    for stream, (ax, matrix) in enumerate(zip(axes[0], matrices, strict=True)):
        image = ax.imshow(np.ma.masked_invalid(matrix), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(columns)), columns)
        ax.set_yticks(range(len(routed)), [_site_label(r) for r in routed], fontsize=7)
        ax.set_xlabel("source")
        if n_streams > 1:
            ax.set_title(f"stream {stream}", fontsize=9)
        if stream == 0:
            ax.set_ylabel("reading site (layer.sublayer)")
    fig.colorbar(image, ax=axes[0].tolist(), label="mean weight")
    fig.suptitle(f"{title}\nsources: b0 = embedding, bj = block j, p = open partial", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def entropy_png(rows: list[dict], path: Path, title: str) -> Path:
    routed = [r for r in rows if "entropy" in r]
    x = range(len(routed))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(x, [r["effective_sources"] for r in routed], "o-", label="effective sources exp(H)")
    ax.plot(x, [len(r["sources"]) for r in routed], ":", color="grey", label="sources read (upper bound)")
    ax.set_ylabel("sources")
    twin = ax.twinx()
    twin.plot(x, [r["top1_mass"] for r in routed], "s--", color="tab:red", label="top-1 mass")
    twin.plot(x, [r["embedding_weight"] for r in routed], "^--", color="tab:green", label="embedding weight")
    twin.set_ylim(0, 1)
    twin.set_ylabel("weight")
    ax.set_xticks(list(x), [_site_label(r) for r in routed], rotation=90, fontsize=7)
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def dilution_png(rows: list[dict], baseline: list[dict] | None, path: Path, title: str) -> Path:
    """Per-sublayer input RMS (what PreNorm divides by) and output RMS, against the baseline's."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for data, style, name in ((rows, "-", "this run"), (baseline, "--", "baseline")):
        if not data:
            continue
        sublayers = [r for r in data if r["kind"] != "final"]
        face = "none" if name == "baseline" else None  # open markers: the baseline shows where curves meet
        ax.plot([r["site"] for r in sublayers], [r["input_rms"] for r in sublayers], "o" + style,
                color="tab:blue", mfc=face, label=f"input RMS ({name})")
        ax.plot([r["site"] for r in sublayers], [r["output_rms"] for r in sublayers], "s" + style,
                color="tab:orange", mfc=face, label=f"output RMS ({name})")
    ax.set_yscale("log")
    ax.set_xlabel("sublayer l")
    ax.set_ylabel("RMS per token")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def gates_png(rows: list[dict], path: Path, title: str) -> Path:
    routed = [r for r in rows if "gate_means" in r]
    gates = np.array([r["gate_means"] for r in routed])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for stream in range(gates.shape[1]):
        ax.plot(range(len(routed)), gates[:, stream], "o-", label=f"stream {stream}")
    ax.set_xticks(range(len(routed)), [_site_label(r) for r in routed], rotation=90, fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean gate")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
