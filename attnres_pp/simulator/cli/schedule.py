"""`attnres-pp simulate schedule`: the discrete-event simulation of one pipeline schedule
(`simulator.engine`) with unit costs, costs from the model and a device profile, or costs calibrated
from a measured run; a summary, one JSON object, a Chrome trace and a timeline plot."""

from __future__ import annotations

import argparse
import json

from attnres_pp.cli_flags import refuse
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model, shard_tokens
from attnres_pp.out_paths import check_out_file
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.simulator.calibrate import calibrate_from
from attnres_pp.simulator.cli.flags import (
    add_tensor_parallel_flags,
    model_config,
    model_flags,
    positive_int,
    real,
    tensor_parallel_from,
)
from attnres_pp.simulator.comm import DTYPE_BYTES
from attnres_pp.simulator.costs import PROFILES, DeviceProfile, model_costs, unit_costs
from attnres_pp.simulator.embedding_group import embedding_group_bytes, embedding_group_s
from attnres_pp.simulator.engine import paused_gc, simulate
from attnres_pp.simulator.metrics import format_summary, summarize
from attnres_pp.simulator.plot import plot_timeline


def register(commands) -> None:
    parser = commands.add_parser("schedule", help="discrete-event simulation of a pipeline schedule")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=None)
    parser.add_argument("--stages", type=positive_int, default=None, help="P, pipeline ranks")
    parser.add_argument("--virtual", type=positive_int, default=1, help="V, chunks per rank (default 1)")
    parser.add_argument("--microbatches", type=positive_int, default=None, help="m, microbatches per step")
    parser.add_argument("--costs", choices=("unit", "model"), default="unit",
                        help="unit: F=1, B=2 per rank and microbatch, free links (default); "
                             "model: FLOPs and links from --layers ... and --profile")
    model_flags(parser, required=False)
    parser.add_argument("--no-cache", action="store_true", help="AttnRes without the cross-stage cache")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100-ib")
    parser.add_argument("--tflops", type=real(positive=True, example="400"), default=None,
                        help="achieved TFLOP/s (overrides profile)")
    parser.add_argument("--bandwidth-gbs", type=real(positive=True, example="40"), default=None,
                        help="link GB/s (overrides profile)")
    parser.add_argument("--latency-us", type=real(positive=False, example="10"), default=None,
                        help="link latency (overrides profile)")
    parser.add_argument("--no-overlap", action="store_true", help="a sender is busy for the link time")
    add_tensor_parallel_flags(parser)
    parser.add_argument("--calibrate-from", metavar="RUN_DIR", default=None,
                        help="costs and schedule from a measured run's trace.json and summary.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", metavar="FILE", default=None, help="write a Chrome trace JSON")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="write a timeline PNG")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        # Checked first: a bad path would otherwise fail after the simulation, with a traceback.
        if args.trace:
            check_out_file(args.trace, "--trace", "trace.json")
        if args.plot:
            check_out_file(args.plot, "--plot", "timeline.png")
        with paused_gc():
            report, result = _simulate_schedule(args)
    except ValueError as error:  # ScheduleError included: its table follows the first line
        return refuse(error, full=True)
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
        for key in ("embed_all_reduce_s", "step_s", "measured_makespan_s", "measured_bubble_fraction"):
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
        cfg = model_config(args)
    elif args.costs == "model":
        raise ValueError("--costs model needs the model: give --layers and --block-size")

    plan = tensor_bytes = tp = None
    if args.tensor_parallel > 1 and (cfg is None or calibration is not None):
        raise ValueError("--tensor-parallel needs the model (--layers and --block-size) and no --calibrate-from: "
                         "a measured run has no tp axis")
    if cfg is not None:
        tp = tensor_parallel_from(args, cfg, tokens=tokens, n_stages=n_stages)
        partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule.placement)
        plan = plan_for_model(cfg, partition, cache)
        width = cfg.d_model if plan.mode == "standard" else cfg.source_width
        if tokens is not None:
            tensor_bytes = shard_tokens(tokens, tp.size, tp.sp) * width * DTYPE_BYTES[args.dtype]

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
                            dtype_bytes=DTYPE_BYTES[args.dtype], overlap_comm=not args.no_overlap, tp=tp,
                            tp_bytes_per_s=args.intra_node_gbps * 1e9 / 8,
                            tp_latency_s=args.intra_node_latency_us * 1e-6)
    else:
        costs = unit_costs(n_stages, n_virtual)

    result = simulate(schedule, costs)
    report = summarize(result, plan=plan, tensor_bytes=tensor_bytes)
    if args.costs == "model" and calibration is None:
        _price_embedding_group(report, cfg, partition, profile)
    if tp is not None and tp.size > 1:
        report["tensor_parallel"], report["sequence_parallel"] = tp.size, tp.sp
    if calibration is not None:
        report["measured_makespan_s"] = calibration.measured_makespan_s
        report["measured_bubble_fraction"] = calibration.measured_bubble_fraction
    return report, result


def _price_embedding_group(report: dict, cfg, partition, profile: DeviceProfile) -> None:
    """Tied embeddings on two ranks: the embedding group's all-reduce after the pipeline, on the
    profile's link between ranks (`simulator.embedding_group`), and the step it makes."""
    if not embedding_group_bytes(cfg, partition):
        return
    report["embed_all_reduce_bytes"] = embedding_group_bytes(cfg, partition)
    report["embed_all_reduce_s"] = embedding_group_s(cfg, partition, bytes_per_s=profile.link_bytes_per_s,
                                                     latency_s=profile.link_latency_s)
    report["step_s"] = report["makespan"] + report["embed_all_reduce_s"]
