"""`attnres-pp simulate predict`: a run the simulator has not seen, priced by a calibration that
transfers (`simulator.transfer`), read from an `attnres-lab fidelity` result file (its "calibration") or
a file holding that object alone.

Numbers are parsed by `attnres_pp.cli_flags`, not by argparse, so a bad value is one line `error: ...`
and exit 2.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from attnres_pp.cli_flags import layer_counts, number_flag, refuse
from attnres_pp.comm.link import LinkModel
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import summarize
from attnres_pp.simulator.transfer import RunShape, TransferCalibration

MODES = ("standard", "naive", "cached")


def register(commands) -> None:
    parser = commands.add_parser(
        "predict", help="predict a run's step from a calibration that transfers (attnres-lab fidelity's)",
        description="The step of a pipelined run of the calibrated model width and microbatch, for any "
                    "schedule, V, m, payload mode, depth, layer split, block size and emulated link, from the "
                    "calibration `attnres-lab fidelity` writes (the 'calibration' object of its JSON).")
    parser.add_argument("--calibration", metavar="FILE", required=True,
                        help="attnres-lab fidelity's result JSON, or a file holding its 'calibration' object")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=None, help="default: the calibration's")
    for flag, help_text in (("--stages", "P"), ("--virtual", "V"), ("--microbatches", "m"),
                            ("--layers", "transformer layers"), ("--block-size", "sublayers per block (1 = Full)")):
        parser.add_argument(flag, metavar="N", default=None, help=f"{help_text} (default: the calibration's)")
    parser.add_argument("--mode", choices=MODES, default=None, help="payload mode (default: the calibration's)")
    parser.add_argument("--layer-counts", metavar="N,N,..", default=None, help="layers per chunk")
    parser.add_argument("--link-gbps", metavar="X", default=None, help="an emulated link's bandwidth, Gb/s")
    parser.add_argument("--link-latency-us", metavar="Y", default=None, help="its latency, microseconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _count(flag: str, raw: str | None, default: int) -> int:
    """The flag's positive integer, or the calibration's value when it is not given."""
    return default if raw is None else number_flag(flag, raw, int, bound="> 0")


def load_calibration(path: str) -> TransferCalibration:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--calibration {path}: cannot read it as JSON ({error})") from None
    values = values.get("calibration", values)
    try:
        return TransferCalibration.from_dict(values)
    except (KeyError, TypeError):
        raise ValueError(f"--calibration {path} holds no calibration: give a result file of "
                         "`attnres-lab fidelity` (newer than its first version)") from None


def target_shape(args: argparse.Namespace, base: RunShape) -> RunShape:
    mode = args.mode or base.mode
    model = base.model
    layers = _count("--layers", args.layers, model.n_layers)
    block_size = _count("--block-size", args.block_size, model.block_size if model.residual != "standard" else 4)
    residual = "standard" if mode == "standard" else "attnres"
    model = replace(model, n_layers=layers, residual=residual, block_size=1 if mode == "standard" else block_size)
    link = None
    if args.link_gbps is not None:
        link = LinkModel(gbps=number_flag("--link-gbps", args.link_gbps, float),
                         latency_s=number_flag("--link-latency-us", args.link_latency_us or "0", float) * 1e-6)
    elif args.link_latency_us is not None:
        raise ValueError("--link-latency-us needs --link-gbps (the emulated link's bandwidth)")
    return RunShape(model=model, schedule=args.schedule or base.schedule,
                    n_stages=_count("--stages", args.stages, base.n_stages),
                    n_virtual=_count("--virtual", args.virtual, base.n_virtual),
                    n_microbatches=_count("--microbatches", args.microbatches, base.n_microbatches),
                    microbatch_size=base.microbatch_size, cache=mode == "cached",
                    layer_counts=layer_counts(args.layer_counts), link=link, dtype_bytes=base.dtype_bytes)


def run(args: argparse.Namespace) -> int:
    try:
        calibration = load_calibration(args.calibration)
        shape = target_shape(args, calibration.calibrated_on)
        schedule = build_schedule(shape.schedule, shape.n_stages, shape.n_virtual, shape.n_microbatches)
        result = simulate(schedule, calibration.costs(shape))
    except ValueError as error:
        return refuse(error)
    report = summarize(result)
    out = {"schedule": shape.schedule, "P": shape.n_stages, "V": shape.n_virtual, "m": shape.n_microbatches,
           "mode": shape.mode, "layers": shape.model.n_layers, "block_size": shape.model.block_size,
           "layer_counts": list(shape.partition().layers_per_chunk),
           "link_gbps": shape.link.gbps if shape.link else None,
           "predicted_step_s": result.makespan, "bubble_fraction": report["bubble_fraction"],
           "compute_s_per_rank": [round(c, 9) for c in result.compute_s],
           "calibrated_on": calibration.calibrated_on.to_dict()}
    if args.json:
        print(json.dumps(out))
        return 0
    link = f", link {shape.link.gbps:g} Gb/s + {shape.link.latency_s * 1e6:g} us" if shape.link else ""
    print(f"{shape.schedule} P={shape.n_stages} V={shape.n_virtual} m={shape.n_microbatches} {shape.mode}, "
          f"{shape.model.n_layers} layers (per chunk {out['layer_counts']}), block {shape.model.block_size}{link}")
    print(f"predicted step   {result.makespan * 1e3:.1f} ms (pipeline window)")
    print(f"bubble_fraction  {report['bubble_fraction']:.4f}")
    return 0
