"""`attnres-pp plot RUN [RUN ...]`: training loss and validation loss against tokens seen for several
runs on one figure, each labelled by its variant and configuration (read from its summary.json, or
from its newest checkpoint while it still trains)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnres_pp.out_paths import check_out_file


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="loss and val loss against tokens for several runs",
                                   description="Draw the loss curves of training runs on one figure.")
    parser.add_argument("runs", metavar="RUN", nargs="+", help="training run directories (their --out)")
    parser.add_argument("--out", metavar="FILE.png", default="runs.png", help="the figure (default runs.png)")
    parser.set_defaults(func=main)


def run_curves(run_dir: str | Path) -> dict:
    """{"label", "tokens", "loss", "val_tokens", "val_loss"} of a run; ValueError if it has no records."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"RUN {run_dir} has no metrics.jsonl: give the --out directory of a training run")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = _run_config(run_dir)
    tokens_per_step = config["train"]["batch_size"] * config["model"]["seq_len"]
    tokens = [(r["step"] + 1) * tokens_per_step for r in records]
    val = [(t, r["val_loss"]) for t, r in zip(tokens, records, strict=True) if "val_loss" in r]
    return {"label": f"{run_dir.name}: {describe_model(config['model'])}", "tokens": tokens,
            "loss": [r["loss"] for r in records], "val_tokens": [t for t, _ in val], "val_loss": [v for _, v in val]}


def _run_config(run_dir: Path) -> dict:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())["config"]
    from attnres_pp.train.checkpoint import latest_checkpoint, read_meta

    step_dir = latest_checkpoint(run_dir)
    if step_dir is None:
        raise ValueError(f"RUN {run_dir} has neither summary.json nor a checkpoint to read its config from")
    return read_meta(step_dir)["config"]


def describe_model(model: dict) -> str:
    """e.g. "attnres N=4 blocks, 6 layers, d 64" or "standard, 6 layers, d 64"."""
    residual = model["residual"]
    if residual == "standard":
        routing = "standard"
    else:
        blocks = f"N={model['blocks']} blocks" if model.get("blocks") else f"S={model['block_size']}"
        routing = f"{residual} {blocks}"
        if residual == "lr_attnres":
            routing += f" {model['key_mode']} r={model['key_rank']}"
        if model.get("key_norm_gain"):
            routing += " +key gain"
    return f"{routing}, {model['n_layers']} layers, d {model['d_model']}"


def plot_runs(run_dirs: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [run_curves(r) for r in run_dirs]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, curve in enumerate(curves):
        color = f"C{index % 10}"
        ax.plot(curve["tokens"], curve["loss"], color=color, alpha=0.6, lw=1, label=f"{curve['label']} (train)")
        if curve["val_loss"]:
            ax.plot(curve["val_tokens"], curve["val_loss"], "o--", color=color, label=f"{curve['label']} (val)")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    try:
        out = Path(args.out)
        check_out_file(out, "--out", "runs.png")
        if out.suffix.lower() != ".png":
            raise ValueError(f"--out {out} must end in .png")
        plot_runs(args.runs, out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(args.runs)} runs)")
    return 0
