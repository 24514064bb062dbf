"""`attnres-pp analyze RUN`: depth-routing diagnostics of a run's checkpoint (analysis.diagnostics),
written as DIR/routing.json and PNGs (analysis.figures); `--json` prints the same object. An MoE
run's expert loads (analysis.experts, from its summary.json and metrics.jsonl) go in the same JSON
under `experts` and beside the depth routing in experts.png."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnres_pp.cli_flags import convert_flag
from attnres_pp.out_paths import check_out_dir


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze", help="depth-routing diagnostics of a trained checkpoint (heatmaps, entropy, dilution)",
        description="Load a checkpoint in one process (any split it was trained with), evaluate K held-out "
                    "batches and write, per reading site, the mean weight on each source, routing entropy, "
                    "effective number of sources, top-1 mass, input/output RMS and MSAR gate means; for a "
                    "mixture-of-experts run also the tokens per expert of every MoE layer and its max / mean "
                    "load over the steps (experts.png, beside the depth routing).")
    parser.add_argument("run", metavar="RUN", help="a training run's --out directory")
    parser.add_argument("--checkpoint", metavar="step_N", help="which checkpoint (default the newest)")
    parser.add_argument("--batches", metavar="K", default="4", help="held-out batches to evaluate (default 4)")
    parser.add_argument("--out", metavar="DIR", help="where routing.json and the PNGs go (default RUN/analysis)")
    parser.add_argument("--baseline", metavar="RUN", help="a standard-residual run: its RMS curve is drawn too")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(func=main)


def analyze(run_dir: str, *, checkpoint: str | None, n_batches: int, out_dir: Path,
            baseline_dir: str | None) -> dict:
    """Diagnose `run_dir`, write routing.json and the PNGs under `out_dir`; returns the JSON object."""
    from attnres_pp.analysis import figures
    from attnres_pp.analysis.diagnostics import held_out_loss, load_run, routing_diagnostics
    from attnres_pp.analysis.experts import expert_loads, experts_png

    run = load_run(run_dir, checkpoint)
    baseline = load_run(baseline_dir, None, "--baseline") if baseline_dir else None
    if baseline is not None and baseline.model_cfg.n_sublayers != run.model_cfg.n_sublayers:
        raise ValueError(f"--baseline {baseline_dir} has {baseline.model_cfg.n_layers} layers, the run "
                         f"{run.model_cfg.n_layers}: give a baseline of the same depth")
    sites = routing_diagnostics(run, n_batches)
    baseline_sites = routing_diagnostics(baseline, n_batches) if baseline else None
    cfg = run.model_cfg
    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"{Path(run_dir).name} ({cfg.residual}, {cfg.n_layers} layers, {run.step_dir.name})"
    pngs = [figures.dilution_png(sites, baseline_sites, out_dir / "dilution.png", f"magnitudes: {label}")]
    if cfg.uses_depth_attention:
        pngs.append(figures.heatmap_png(sites, cfg.n_streams, out_dir / "heatmap.png", f"depth routing: {label}"))
        pngs.append(figures.entropy_png(sites, out_dir / "entropy.png", f"routing entropy: {label}"))
    if cfg.residual == "msar":
        pngs.append(figures.gates_png(sites, out_dir / "gates.png", f"MSAR gates: {label}"))
    loads = expert_loads(run_dir) if cfg.moe else None
    if loads is not None:
        pngs.append(experts_png(loads, sites if cfg.uses_depth_attention else None, out_dir / "experts.png",
                                f"expert loads: {label}", cfg.n_streams))
    result = {
        "run": str(run_dir), "checkpoint": run.step_dir.name, "steps_done": run.steps_done,
        "model": cfg.to_dict(), "block_ends": list(cfg.block_ends), "batches": n_batches,
        "val_loss": held_out_loss(run, n_batches), "sites": sites,
        "baseline": None if baseline is None else {"run": str(baseline_dir), "sites": baseline_sites},
        "experts": None if loads is None else loads.to_json(),
        "pngs": [str(p) for p in pngs],
    }
    (out_dir / "routing.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(args: argparse.Namespace) -> int:
    try:
        n_batches = convert_flag("--batches", args.batches, int)
        out_dir = Path(args.out) if args.out else Path(args.run) / "analysis"
        check_out_dir(out_dir, "--out")
        result = analyze(args.run, checkpoint=args.checkpoint, n_batches=n_batches, out_dir=out_dir,
                         baseline_dir=args.baseline)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['run']} {result['checkpoint']}: held-out loss {result['val_loss']:.4f} over {n_batches} batches")
    for row in result["sites"]:
        if "entropy" in row:
            print(f"  site {row['site']:>3} ({row['kind']:>5}): entropy {row['entropy']:.3f}, effective sources "
                  f"{row['effective_sources']:.2f}/{len(row['sources'])}, top-1 {row['top1_mass']:.3f}, "
                  f"embedding {row['embedding_weight']:.3f}")
    experts = result["experts"]
    if experts is not None:
        for layer, tokens, ratio in zip(experts["layers"], experts["last_step_tokens_per_expert"],
                                        experts["last_step_max_over_mean"], strict=True):
            print(f"  MoE layer {layer:>3}: last step's tokens per expert {[int(t) for t in tokens]}, "
                  f"max / mean {ratio:.2f}")
    print(f"wrote {out_dir / 'routing.json'} and {', '.join(Path(p).name for p in result['pngs'])}")
    return 0
