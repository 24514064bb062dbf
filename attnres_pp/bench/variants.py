"""`attnres-pp bench variants [--quick] [--compile]`: the step time of every residual variant over the
standard residual, in one process and pipelined (P = 2, V = 2, cross-stage cache on), at two shapes:
the quality benchmark's (4 layers, d = 64, 256 tokens a step) and 16 layers, d = 256 with 1,024 tokens
a step (4 sequences of 256; where the targets are set). Both use ModelConfig's default layer recipe
(rotary positions, SwiGLU), recorded with the result.

Single process: forward + backward of one batch through the whole model, one thread, every variant
built first and then run in rotation (A B C .., B C A .., ...) so drift in the machine's load falls
on every variant alike; warm-up rounds are dropped. Pipelined: one `TimedEngine` per variant (the
driver's wall time of a whole optimiser step over the same global batch split into microbatches),
stepped in the same rotation. The headline `ratios` are the median over rounds of (variant /
standard in the same round); each of `TARGETS` is judged met or missed in both modes at 16 layers,
d = 256. `--compile` adds every variant's compiled model (`Transformer(compile=True)`) to the same
single-process rotation as the eager ones and reports per variant the compiled / eager step (the
median over rounds of the pair, `compiled_over_eager`) and the compile time (the first step,
`compile_s`). The full run adds a torch.profiler table of the ops that grow most over standard at
16 layers, d = 256 for every targeted variant that missed (what is left where a target is missed).
The load average is recorded before and after: the ratios are paired, the absolute times are not.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import TimedEngine, markdown_table, random_batch, run_config
from attnres_pp.bench.common import results_stem as common_results_stem

HEADS = 4  # query heads of both shapes (`--kv-heads` divides them)
QUALITY_SHAPE = {"vocab_size": 256, "n_layers": 4, "d_model": 64, "n_heads": HEADS, "seq_len": 64}
TARGET_SHAPE = {"vocab_size": 256, "n_layers": 16, "d_model": 256, "n_heads": HEADS, "seq_len": 256}
SHAPES = {"4L_d64": (QUALITY_SHAPE, 2), "16L_d256": (TARGET_SHAPE, 4)}  # shape, block size of its variants
TARGET_LABEL = "16L_d256"
SINGLE_BATCH = 4  # sequences per step, single process and pipelined (the global batch): 1,024 tokens at the target
# The pipelined step splits the same global batch into its microbatches (SINGLE_BATCH / microbatches each).
PIPELINE = {"stages": 2, "virtual": 2, "schedule": "interleaved_1f1b", "microbatches": 4, "cache": True}
MODES = ("single_process", "pipelined")
# 16 layers, d = 256: the targets (variant / standard), judged in both modes.
TARGETS = {"block_attnres": 1.10, "s_lr_attnres": 1.10, "full_attnres": 1.5, "msar": 2.0}
COMPILED = "+compiled"  # the key suffix of a variant's compiled model within one rotation


def variant_overrides(block_size: int) -> dict[str, dict]:
    """Each variant's ModelConfig fields beyond the shape (Block and LR variants use `block_size`)."""
    return {
        "standard": {"residual": "standard", "block_size": 1},
        "full_attnres": {"residual": "attnres", "block_size": 1},
        "block_attnres": {"residual": "attnres", "block_size": block_size},
        "p_lr_attnres": {"residual": "lr_attnres", "block_size": block_size, "key_mode": "projected", "key_rank": 8},
        "s_lr_attnres": {"residual": "lr_attnres", "block_size": block_size, "key_mode": "sliced", "key_rank": 8},
        "msar": {"residual": "msar", "block_size": block_size},
    }


def selected(overrides: dict[str, dict], names: tuple[str, ...] | None) -> dict[str, dict]:
    """`overrides` of `names` only (standard always: every ratio's denominator); None: all of them."""
    return overrides if names is None else {n: o for n, o in overrides.items() if n == "standard" or n in names}


def _rotations(names: tuple[str, ...], n_rounds: int):
    """Round r runs the names shifted by r: each variant takes each position equally often."""
    for index in range(n_rounds):
        shift = index % len(names)
        yield index, names[shift:] + names[:shift]


def paired_ratios(times: dict[str, list[float]], base: str = "standard") -> dict[str, float]:
    """Median over rounds of times[name][r] / times[base][r] for every name but `base`."""
    return {name: statistics.median(a / b for a, b in zip(samples, times[base], strict=True))
            for name, samples in times.items() if name != base}


def single_process(shape: dict, block_size: int, warmup: int, rounds: int, *, compile_model: bool = False,
                   names: tuple[str, ...] | None = None) -> dict:
    """Median forward + backward time per variant in this process (one thread), rotation order.

    With `compile_model` every variant is built twice, eager and compiled (the same weights), and
    all of them run in one rotation, so that the compiled / eager ratio of a variant is paired
    within a round like the variant / standard ones; the eager figures are the returned dict and the
    compiled ones its "compiled" entry (with "first_step_s", the step that compiles, and
    "compiled_over_eager", the median over rounds of compiled / eager step of each variant)."""
    import torch

    from attnres_pp.model import ModelConfig, Transformer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models, first_step_s = {}, {}
        for name, overrides in selected(variant_overrides(block_size), names).items():
            cfg = ModelConfig.from_dict({**shape, **overrides})
            torch.manual_seed(0)
            models[name] = Transformer(cfg)
            if compile_model:
                torch.manual_seed(0)
                models[name + COMPILED] = Transformer(cfg, compile=True)
        inputs_BT, targets_BT = random_batch(0, SINGLE_BATCH, shape["seq_len"], shape["vocab_size"])

        def step(name: str) -> float:
            started = time.perf_counter()
            models[name](inputs_BT, targets_BT).backward()
            for p in models[name].parameters():
                p.grad = None
            return time.perf_counter() - started

        # The first step compiles: timed apart from the steps that reuse the cache.
        first_step_s = {name.removesuffix(COMPILED): step(name) for name in models if name.endswith(COMPILED)}
        times: dict[str, list[float]] = {name: [] for name in models}
        for index, order in _rotations(tuple(models), warmup + rounds):
            for name in order:
                elapsed = step(name)
                if index >= warmup:
                    times[name].append(elapsed)
    finally:
        torch.set_num_threads(threads)
    eager = {name: t for name, t in times.items() if not name.endswith(COMPILED)}
    out = _timed(eager)
    if compile_model:
        compiled = {name.removesuffix(COMPILED): t for name, t in times.items() if name.endswith(COMPILED)}
        out["compiled"] = {**_timed(compiled), "first_step_s": first_step_s,
                           "compiled_over_eager": {name: statistics.median(c / e for c, e in zip(
                               compiled[name], eager[name], strict=True)) for name in eager}}
    return out


def _timed(times: dict[str, list[float]]) -> dict:
    return {"step_s": {name: statistics.median(t) for name, t in times.items()}, "ratios": paired_ratios(times),
            "step_s_all": times}


def pipelined(shape: dict, block_size: int, warmup: int, rounds: int, names: tuple[str, ...] | None = None) -> dict:
    """Median driver wall time of an optimiser step per variant, P = 2 V = 2, engines in rotation."""
    engines: dict[str, TimedEngine] = {}
    try:
        for name, overrides in selected(variant_overrides(block_size), names).items():
            engines[name] = TimedEngine(run_config({**shape, **overrides}, **PIPELINE,
                                                   microbatch_size=SINGLE_BATCH // PIPELINE["microbatches"]))
        for _index, order in _rotations(tuple(engines), warmup + rounds):
            for name in order:
                engines[name].step()
    finally:
        for engine in engines.values():
            engine.close()
    times = {name: [s.wall_s for s in engine.samples[warmup:]] for name, engine in engines.items()}
    # Every round's times kept: the spread of the paired ratios is the run's noise.
    return {"step_s": {name: statistics.median(t) for name, t in times.items()}, "ratios": paired_ratios(times),
            "step_s_all": times, "bytes_per_step": {name: e.samples[-1].bytes_sent for name, e in engines.items()}}


def profile_growth(shape: dict, block_size: int, variants: tuple[str, ...], top: int = 10) -> dict[str, list[dict]]:
    """torch.profiler self CPU time per op and forward + backward, for each of `variants` against
    standard: the ops whose time grows most (where the remaining overhead goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from attnres_pp.model import ModelConfig, Transformer

    inputs_BT, targets_BT = random_batch(0, SINGLE_BATCH, shape["seq_len"], shape["vocab_size"])
    per_variant: dict[str, dict[str, tuple[float, int]]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in ("standard", *variants):
            model = Transformer(ModelConfig.from_dict({**shape, **variant_overrides(block_size)[name]}))
            model(inputs_BT, targets_BT).backward()  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    model(inputs_BT, targets_BT).backward()
            per_variant[name] = {e.key: (e.self_cpu_time_total / 3e3, e.count // 3) for e in prof.key_averages()}
    finally:
        torch.set_num_threads(threads)
    base = per_variant["standard"]
    out = {}
    for name in variants:
        rows = [{"op": op, "standard_ms": base.get(op, (0.0, 0))[0], "variant_ms": ms, "calls": calls,
                 "extra_ms": ms - base.get(op, (0.0, 0))[0]} for op, (ms, calls) in per_variant[name].items()]
        out[name] = sorted(rows, key=lambda r: -r["extra_ms"])[:top]
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="also time every variant with its sublayers torch.compile'd")
    parser.add_argument("--kv-heads", type=int, default=None, metavar="N",
                        help=f"key/value heads of every shape (grouped-query attention; divides the shapes' "
                             f"{HEADS} query heads); default {HEADS}, multi-head attention")
    parser.add_argument("--variants", default=None, metavar="NAME,...",
                        help="time only these variants beside the standard residual (comma-separated, of "
                             f"{', '.join(n for n in variant_overrides(1) if n != 'standard')}); default every one")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help="timed rounds of each mode (after its warm-up rounds); default 12 one process and "
                             "8 pipelined (4 and 3 with --quick)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="time one mode only (default both)")


def check(args) -> str | None:
    if args.kv_heads is not None and (args.kv_heads < 1 or HEADS % args.kv_heads):
        return f"--kv-heads {args.kv_heads} must divide the shapes' {HEADS} query heads: give 1, 2 or 4"
    if args.rounds is not None and args.rounds < 1:
        return f"--rounds {args.rounds} must be >= 1"
    if args.variants is not None:
        known = tuple(n for n in variant_overrides(1) if n != "standard")
        unknown = [n for n in args.variants.split(",") if n not in known]
        if unknown or not args.variants:
            return f"--variants {args.variants!r}: name one or more of {', '.join(known)}, comma-separated"
    return None


def run_options(args) -> dict:
    options = {"compile_model": args.compile, "kv_heads": args.kv_heads}
    # The selections only where given: a plain run's options are what they always were.
    if args.variants is not None:
        options["names"] = tuple(args.variants.split(","))
    if args.rounds is not None:
        options["rounds"] = args.rounds
    if args.mode is not None:
        options["modes"] = (args.mode,)
    return options


def results_stem(args) -> str:
    # --compile and --kv-heads results sit beside the plain run's of the same day, never over them.
    stem = "variants_compile" if args.compile else "variants"
    if args.kv_heads not in (None, HEADS):
        stem += f"_kv{args.kv_heads}"
    if args.variants is not None:  # a selection never replaces the run of every variant
        stem += "_" + "-".join(args.variants.split(","))
    if args.mode is not None:
        stem += "_" + args.mode
    return common_results_stem(stem, args.quick)


def shapes_with(kv_heads: int | None) -> dict[str, tuple[dict, int]]:
    """SHAPES with `kv_heads` key/value heads (None: as many as query heads)."""
    if kv_heads is None:
        return dict(SHAPES)
    return {label: ({**shape, "n_kv_heads": kv_heads}, block) for label, (shape, block) in SHAPES.items()}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None], compile_model: bool = False,
        kv_heads: int | None = None, names: tuple[str, ...] | None = None, rounds: int | None = None,
        modes: tuple[str, ...] = MODES) -> dict:
    del out_dir  # tables only
    shapes = shapes_with(kv_heads)
    load_before = _load_average()
    # Fewer rounds than at 256 tokens a step: a 1,024-token round of six variants at 16 layers takes
    # tens of seconds on a shared 2-core machine; the paired median holds up with a dozen rounds.
    warmup, single_rounds = (1, 4) if quick else (2, 12)
    pipe_warmup, pipe_rounds = (1, 3) if quick else (2, 8)
    single_rounds, pipe_rounds = (single_rounds, pipe_rounds) if rounds is None else (rounds, rounds)
    single, piped, compiled = {}, {}, {}
    for label, (shape, block_size) in (shapes.items() if "single_process" in modes else ()):
        single[label] = single_process(shape, block_size, warmup, single_rounds, compile_model=compile_model,
                                       names=names)
        progress(f"  {label} one process: " + _ratio_line(single[label]["ratios"]))
        if compile_model:
            compiled[label] = single[label].pop("compiled")
            progress(f"  {label} one process, compiled: " + _ratio_line(compiled[label]["ratios"]))
            progress(f"  {label} compiled / eager: " + _ratio_line(compiled[label]["compiled_over_eager"]))
    # Pipelined: the quality shape always, the 16-layer target shape only in the full run (minutes per round).
    for label in (("4L_d64",) if quick else tuple(shapes)) if "pipelined" in modes else ():
        shape, block_size = shapes[label]
        piped[label] = pipelined(shape, block_size, pipe_warmup, pipe_rounds, names)
        progress(f"  {label} P=2 V=2: " + _ratio_line(piped[label]["ratios"]))
    timed = tuple(selected(variant_overrides(1), names))
    ratios = {name: {"single_process": {label: single[label]["ratios"][name] for label in single},
                     "pipelined": {label: piped[label]["ratios"][name] for label in piped}}
              for name in timed if name != "standard"}
    if compile_model:
        for name in ratios:
            ratios[name]["single_process_compiled"] = {label: compiled[label]["ratios"][name] for label in compiled}
    targets = judge_targets({"single_process": single, "pipelined": piped})
    payload = {"ratios": ratios, f"targets_{TARGET_LABEL}": targets, "single_process": single,
               "pipelined": piped, "shapes": {label: _shape_record(s, b) for label, (s, b) in shapes.items()},
               "single_batch": SINGLE_BATCH, "pipeline": PIPELINE, "warmup_rounds": warmup, "rounds": single_rounds,
               "pipeline_warmup_rounds": pipe_warmup, "pipeline_rounds": pipe_rounds, "compile": compile_model,
               "note": "ratio = median over rounds of (variant step / standard step in the same round); variants "
                       "run in rotation; single process = forward + backward of one batch, one thread; "
                       "pipelined = the driver's wall time of a whole optimiser step over the same global batch"}
    if compile_model:
        payload["compiled"] = compiled
        # Per variant (standard included): compiled / eager step paired within a round, and the first step.
        payload["compiled_over_eager"] = {label: c["compiled_over_eager"] for label, c in compiled.items()}
        payload["compile_s"] = {label: c["first_step_s"] for label, c in compiled.items()}
    missed = tuple(name for name in TARGETS if any(name in t and not t[name]["met"] for t in targets.values()))
    if not quick and missed:
        shape, block_size = shapes[TARGET_LABEL]
        payload[f"profile_{TARGET_LABEL}"] = profile_growth(shape, block_size, missed)
    payload["variants"] = list(timed)
    payload["load_average"] = {"before": load_before, "after": _load_average()}
    return payload


def judge_targets(results: dict[str, dict]) -> dict[str, dict]:
    """Per mode measured at the target shape: each of TARGETS' ratio, its bound and whether it is met."""
    return {mode: {name: {"target": bound, "measured": by_label[TARGET_LABEL]["ratios"][name],
                          "met": by_label[TARGET_LABEL]["ratios"][name] <= bound}
                   for name, bound in TARGETS.items() if name in by_label[TARGET_LABEL]["ratios"]}
            for mode, by_label in results.items() if TARGET_LABEL in by_label}


def _shape_record(shape: dict, block_size: int) -> dict:
    """The shape with the layer recipe the defaults filled in and the tokens of a step."""
    from attnres_pp.model import ModelConfig

    cfg = ModelConfig.from_dict(dict(shape))
    return {"model": shape, "block_size": block_size, "positions": cfg.positions, "mlp": cfg.mlp,
            "ff_dim": cfg.ff_dim, "kv_heads": cfg.kv_heads, "tokens_per_step": SINGLE_BATCH * cfg.seq_len}


def _load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (NaN where the system has none)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [round(x, 2) for x in load]


def _ratio_line(ratios: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.3f}" for name, value in ratios.items())


def to_markdown(payload: dict) -> str:
    names = list(payload["ratios"])
    lines = ["## Step time of every variant over the standard residual", "",
             f"One process: forward + backward of {payload['single_batch']} sequences, one thread, median of "
             f"{payload['rounds']} rounds after {payload['warmup_rounds']} (variants in rotation). Pipelined: "
             f"{payload['pipeline']['schedule']} P={payload['pipeline']['stages']} V={payload['pipeline']['virtual']} "
             f"m={payload['pipeline']['microbatches']}, cache {'on' if payload['pipeline'].get('cache') else 'off'}, "
             "the same global batch split into the microbatches, the driver's wall time of an optimiser step, "
             f"median of {payload['pipeline_rounds']} rounds after {payload['pipeline_warmup_rounds']}. Ratio = "
             "median over rounds of variant / standard in the same round.", ""]
    lines += [f"- {label}: " + _shape_line(record) for label, record in payload["shapes"].items() if record]
    lines += [""] if any(payload["shapes"].values()) else []
    headers, rows = ["variant"], []
    columns = [(mode, label) for mode in ("single_process", "single_process_compiled", "pipelined")
               for label in payload["shapes"] if label in payload["ratios"][names[0]].get(mode, {})]
    headers += [f"{label} {mode.replace('_', ' ')}" for mode, label in columns]
    rows.append(["standard (ms)"] + [_standard_ms(payload, mode, label) for mode, label in columns])
    for name in names:
        rows.append([name] + [f"{payload['ratios'][name][mode][label]:.3f}" for mode, label in columns])
    lines += [markdown_table(headers, rows)]
    for mode, targets in payload[f"targets_{TARGET_LABEL}"].items():
        lines += ["", f"Targets at {TARGET_LABEL}, {mode.replace('_', ' ')}:", ""]
        lines += [f"- {name}: {t['measured']:.3f} (target <= {t['target']}) {'met' if t['met'] else 'missed'}"
                  for name, t in targets.items()]
    if "load_average" in payload:
        lines += ["", f"Load average (1, 5, 15 min) before {payload['load_average']['before']}, "
                      f"after {payload['load_average']['after']}."]
    for label, result in payload.get("compiled", {}).items():
        first = ", ".join(f"{n} {s:.1f} s" for n, s in result["first_step_s"].items())
        lines += ["", f"Compiled, {label}: first step (compiles) {first}; later steps reuse the compiled graphs."]
        lines += ["Compiled / eager step (median over rounds of the pair in one rotation): " + ", ".join(
            f"{n} {r:.3f}" for n, r in result["compiled_over_eager"].items())]
    for name, rows_ in payload.get(f"profile_{TARGET_LABEL}", {}).items():
        lines += ["", f"Ops that grow most from standard to {name} (16 layers, d = 256; self CPU ms per forward "
                      "+ backward):", "",
                  markdown_table(["op", "standard (ms)", f"{name} (ms)", "extra (ms)", "calls"],
                                 [[r["op"], r["standard_ms"], r["variant_ms"], r["extra_ms"], r["calls"]]
                                  for r in rows_])]
    return "\n".join(lines)


def _shape_line(record: dict) -> str:
    model = record["model"]
    return (f"{model['n_layers']} layers, d = {model['d_model']}, {model['n_heads']} heads, "
            f"seq_len {model['seq_len']}, {record['tokens_per_step']} tokens a step, "
            f"block size {record['block_size']}; {record['positions']} positions, {record['mlp']} "
            f"(ff {record['ff_dim']}), {record['kv_heads']} kv heads")


def _standard_ms(payload: dict, mode: str, label: str) -> str:
    source = {"single_process": payload["single_process"], "pipelined": payload["pipelined"],
              "single_process_compiled": payload.get("compiled", {})}[mode]
    return f"{1e3 * source[label]['step_s']['standard']:.1f}"
