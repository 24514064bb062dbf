"""`attnres-pp simulate comm | schedule | sweep | project | predict | memory | plan`: the simulator's command line.

Flags only fill in the validated objects of the simulator (ModelConfig, CostModel, SweepBase);
a bad value prints one line `attnres-pp simulate X: error: ...` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.config import KEY_MODES, RESIDUALS, ModelConfig
from attnres_pp.out_paths import check_out_dir, check_out_file
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.simulator.calibrate import calibrate_from
from attnres_pp.simulator.comm import DTYPE_BYTES, comm_report, format_comm_table
from attnres_pp.simulator.costs import PROFILES, DeviceProfile, model_costs, unit_costs
from attnres_pp.simulator.engine import paused_gc, simulate
from attnres_pp.simulator.metrics import format_summary, summarize
from attnres_pp.simulator.plot import plot_timeline
from attnres_pp.simulator.sweep import SWEEPS, SweepBase, run_sweeps


def register(subparsers) -> None:
    simulate_parser = subparsers.add_parser(
        "simulate", help="simulate communication volumes and pipeline schedules (no torch needed)",
        description="Communication per hop, discrete-event schedule simulation, and sweeps.")
    commands = simulate_parser.add_subparsers(dest="simulate_command", required=True)

    comm = commands.add_parser("comm", help="tensors and bytes per hop for the four modes")
    _model_flags(comm, required=True)
    comm.add_argument("--stages", type=_count(1), required=True, help="P, pipeline ranks")
    comm.add_argument("--virtual", type=_count(1), default=1, help="V, chunks per rank (default 1)")
    comm.add_argument("--layer-counts", default=None, help="layers per chunk, comma separated")
    comm.add_argument("--json", action="store_true", help="print one JSON object")
    comm.set_defaults(func=_run_comm, parser=comm)

    schedule = commands.add_parser("schedule", help="discrete-event simulation of a pipeline schedule")
    schedule.add_argument("--schedule", choices=sorted(SCHEDULES), default=None)
    schedule.add_argument("--stages", type=_count(1), default=None, help="P, pipeline ranks")
    schedule.add_argument("--virtual", type=_count(1), default=1, help="V, chunks per rank (default 1)")
    schedule.add_argument("--microbatches", type=_count(1), default=None, help="m, microbatches per step")
    schedule.add_argument("--costs", choices=("unit", "model"), default="unit",
                          help="unit: F=1, B=2 per rank and microbatch, free links (default); "
                               "model: FLOPs and links from --layers ... and --profile")
    _model_flags(schedule, required=False)
    schedule.add_argument("--no-cache", action="store_true", help="AttnRes without the cross-stage cache")
    schedule.add_argument("--profile", choices=sorted(PROFILES), default="h100-ib")
    schedule.add_argument("--tflops", type=_real(positive=True, example="400"), default=None,
                          help="achieved TFLOP/s (overrides profile)")
    schedule.add_argument("--bandwidth-gbs", type=_real(positive=True, example="40"), default=None,
                          help="link GB/s (overrides profile)")
    schedule.add_argument("--latency-us", type=_real(positive=False, example="10"), default=None,
                          help="link latency (overrides profile)")
    schedule.add_argument("--no-overlap", action="store_true", help="a sender is busy for the link time")
    schedule.add_argument("--calibrate-from", metavar="RUN_DIR", default=None,
                          help="costs and schedule from a measured run's trace.json and summary.json")
    schedule.add_argument("--json", action="store_true", help="print one JSON object")
    schedule.add_argument("--trace", metavar="FILE", default=None, help="write a Chrome trace JSON")
    schedule.add_argument("--plot", metavar="FILE.png", default=None, help="write a timeline PNG")
    schedule.set_defaults(func=_run_schedule, parser=schedule)

    sweep = commands.add_parser("sweep", help="tables and plots: comm vs depth/blocks/P/V, bubble vs m/V")
    sweep.add_argument("--only", choices=sorted(SWEEPS), default=None, help="run one family of sweeps")
    sweep.add_argument("--out", metavar="DIR", default=None, help="write NAME.png per sweep and sweeps.md")
    sweep.add_argument("--layers", type=_count(1), default=64)
    sweep.add_argument("--blocks", type=_count(1), default=8, help="blocks = sublayers / block size")
    sweep.add_argument("--stages", type=_count(1), default=4)
    sweep.add_argument("--virtual", type=_count(1), default=2)
    sweep.add_argument("--microbatches", type=_count(1), default=16)
    sweep.add_argument("--tokens", type=_count(1), default=4096, help="tokens per microbatch")
    sweep.add_argument("--d-model", type=_count(1), default=4096)
    sweep.add_argument("--key-rank", type=_count(0), default=0, help="extra width of projected low-rank keys")
    sweep.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    sweep.set_defaults(func=_run_sweep, parser=sweep)

    from attnres_pp.simulator import memory_cli, plan_cli, predict_cli, project_cli

    project_cli.register(commands)
    predict_cli.register(commands)
    memory_cli.register(commands, _model_flags, _count)
    plan_cli.register(commands)


def _model_flags(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("--layers", type=_count(1), required=required, default=None, help="transformer layers")
    parser.add_argument("--block-size", type=_count(1), default=None,
                        help="sublayers per block (1 = Full AttnRes)" + ("; this or --blocks is required" if required
                                                                         else ""))
    parser.add_argument("--blocks", type=_count(1), default=None,
                        help="number of blocks N instead of --block-size (block i ends after sublayer ceil(L i / N))")
    parser.add_argument("--residual", choices=RESIDUALS, default="attnres")
    parser.add_argument("--key-mode", choices=KEY_MODES, default="projected")
    parser.add_argument("--key-rank", type=_count(1), default=8, help="r of low-rank keys (lr_attnres)")
    parser.add_argument("--d-model", type=_count(1), default=4096)
    parser.add_argument("--d-ff", type=_count(0), default=0, help="MLP width (0 = 4 x d-model)")
    parser.add_argument("--seq-len", type=_count(1), default=4096)
    parser.add_argument("--vocab-size", type=_count(1), default=32000)
    parser.add_argument("--tokens", type=_count(1), default=4096, help="tokens per microbatch")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")


def _count(minimum: int):
    """argparse type: an integer >= `minimum`; argparse prints the refusal as one line naming the flag."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give a whole number >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid: give an integer >= {minimum}")
        return value

    return count


def _real(*, positive: bool, example: str):
    """argparse type: a finite number > 0 (`positive`) or >= 0; nan and inf would make every figure nan."""
    bound = "> 0" if positive else ">= 0"

    def real(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give e.g. {example}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is invalid: give a finite number {bound}, e.g. {example}")
        return value

    return real


def _fail(args: argparse.Namespace, message: str) -> int:
    print(f"{args.parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _model_config(args: argparse.Namespace) -> ModelConfig:
    if (args.block_size is None) == (args.blocks is None):
        raise ValueError("give exactly one of --block-size S and --blocks N to place the blocks")
    # Heads do not change FLOPs or bytes here, and one head divides every width.
    return ModelConfig(vocab_size=args.vocab_size, n_layers=args.layers, d_model=args.d_model, n_heads=1,
                       d_ff=args.d_ff, seq_len=args.seq_len, residual=args.residual,
                       block_size=args.block_size or 1, blocks=args.blocks or 0, key_mode=args.key_mode,
                       key_rank=args.key_rank)


def _layer_counts(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--layer-counts {text!r} must be integers separated by commas, e.g. 3,3,2,2") from None


def _run_comm(args: argparse.Namespace) -> int:
    try:
        cfg = _model_config(args)
        layer_counts = _layer_counts(args.layer_counts)
        report = comm_report(n_layers=cfg.n_layers, block_size=cfg.block_size, blocks=cfg.blocks,
                             n_stages=args.stages, n_virtual=args.virtual, tokens=args.tokens, d_model=cfg.d_model,
                             source_width=cfg.source_width, dtype=args.dtype, layer_counts=layer_counts)
    except ValueError as error:
        return _fail(args, str(error))
    print(json.dumps(report.to_dict()) if args.json else format_comm_table(report))
    return 0


def _run_schedule(args: argparse.Namespace) -> int:
    try:
        # Checked first: a bad path would otherwise fail after the simulation, with a traceback.
        if args.trace:
            check_out_file(args.trace, "--trace", "trace.json")
        if args.plot:
            check_out_file(args.plot, "--plot", "timeline.png")
        with paused_gc():
            report, result = _simulate_schedule(args)
    except ValueError as error:  # ScheduleError included: its table follows the first line
        return _fail(args, str(error))
    if args.trace:
        report["trace"] = str(write_chrome_trace(result.events(), args.trace))
    if args.plot:
        title = (f"{report['schedule']} P={report['stages']} V={report['virtual']} m={report['microbatches']}"
                 f" ({report['costs']} costs), bubble {report['bubble_fraction']:.3f}")
        report["plot"] = str(plot_timeline(result.events(), args.plot, n_stages=report["stages"], title=title,
                                           time_unit="units" if report["costs"] == "unit" else "s"))
    if args.json:
        print(json.dumps(report))
    else:
        print(format_summary(report))
        for key in ("measured_makespan_s", "measured_bubble_fraction"):
            if key in report:
                print(f"{key:<20}{report[key]:.6g}")
        for key in ("trace", "plot"):
            if key in report:
                print(f"wrote {report[key]}")
    return 0


def _simulate_schedule(args: argparse.Namespace):
    """(report dict, SimResult) for the schedule, costs and model the flags describe."""
    calibration = None
    if args.calibrate_from:
        calibration = calibrate_from(args.calibrate_from)
        name, n_stages = calibration.schedule_name, calibration.n_stages
        n_virtual, n_microbatches = calibration.n_virtual, calibration.n_microbatches
    else:
        missing = [flag for flag, value in (("--schedule", args.schedule), ("--stages", args.stages),
                                            ("--microbatches", args.microbatches)) if value is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or --calibrate-from RUN_DIR)")
        name, n_stages, n_virtual, n_microbatches = args.schedule, args.stages, args.virtual, args.microbatches
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)

    cfg, tokens, cache = None, args.tokens, not args.no_cache
    if calibration is not None:
        cfg, tokens, cache = calibration.model, calibration.microbatch_tokens, calibration.cache
    elif args.layers is not None or args.block_size is not None or args.blocks is not None:
        if args.layers is None or (args.block_size is None and args.blocks is None):
            raise ValueError("give both --layers and --block-size (or --blocks) to describe the model")
        cfg = _model_config(args)
    elif args.costs == "model":
        raise ValueError("--costs model needs the model: give --layers and --block-size")

    plan = tensor_bytes = None
    if cfg is not None:
        partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule.placement)
        plan = plan_for_model(cfg, partition, cache)
        width = cfg.d_model if plan.mode == "standard" else cfg.source_width
        if tokens is not None:
            tensor_bytes = tokens * width * DTYPE_BYTES[args.dtype]

    if calibration is not None:
        costs = calibration.costs
    elif args.costs == "model":
        base = PROFILES[args.profile]
        overridden = any(v is not None for v in (args.tflops, args.bandwidth_gbs, args.latency_us))
        profile = DeviceProfile(
            name=f"{base.name} (overridden)" if overridden else base.name,
            flops_per_s=args.tflops * 1e12 if args.tflops is not None else base.flops_per_s,
            link_bytes_per_s=args.bandwidth_gbs * 1e9 if args.bandwidth_gbs is not None else base.link_bytes_per_s,
            link_latency_s=args.latency_us * 1e-6 if args.latency_us is not None else base.link_latency_s)
        costs = model_costs(cfg, partition, plan, tokens=tokens, profile=profile,
                            dtype_bytes=DTYPE_BYTES[args.dtype], overlap_comm=not args.no_overlap)
    else:
        costs = unit_costs(n_stages, n_virtual)

    result = simulate(schedule, costs)
    report = summarize(result, plan=plan, tensor_bytes=tensor_bytes)
    if calibration is not None:
        report["measured_makespan_s"] = calibration.measured_makespan_s
        report["measured_bubble_fraction"] = calibration.measured_bubble_fraction
    return report, result


def _run_sweep(args: argparse.Namespace) -> int:
    try:
        base = SweepBase(n_layers=args.layers, n_blocks=args.blocks, n_stages=args.stages,
                         n_virtual=args.virtual, n_microbatches=args.microbatches, tokens=args.tokens,
                         d_model=args.d_model, key_rank=args.key_rank, dtype=args.dtype)
        kinds = (args.only,) if args.only else tuple(SWEEPS)
        if args.out:
            check_out_dir(args.out, "--out")
        sweeps = run_sweeps(base, kinds, args.out, progress=lambda line: print(line, file=sys.stderr))
    except ValueError as error:
        return _fail(args, str(error))
    print("\n\n".join(sweep.to_markdown() for sweep in sweeps))
    return 0
