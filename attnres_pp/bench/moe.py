"""`attnres-pp bench moe [--quick]`: the step time of a mixture-of-experts model against the dense
model of equal active parameters, and the routed experts' grouped matmul against its per-expert twin.

- MoE against dense: Block AttnRes, 8 layers, d = 256, seq 256, 4 sequences a step (1,024 tokens),
  every MLP an MoE sublayer of E = 8 routed experts (width d_ff / 4 rounded up to 64), top K = 2,
  S = 1 shared; the dense twin is the same model with SwiGLU MLPs whose width makes its parameter
  count the MoE model's active count (`model.transformer.active_parameter_count`, as near as an
  integer width allows). Each is a one-process run's engine (one thread) and a step is its whole
  `train_step`: forward, backward, AdamW, the aux-free bias update; the two alternate (A B, B A,
  ...) on the same batches so drift in the machine's load falls on both; medians over rounds and
  the median of the within-round ratios.
- The routed experts' computation of one MoE layer at that step (its 2,048 token-choices grouped
  by expert as the router sent them at initialisation), forward and backward, with
  `model.moe.grouped_matmul` (torch._grouped_mm where the build has it) against
  `grouped_matmul_loop` (one matmul per expert), alternating: the measured fallback.
- EP = 2 (`expert_parallel_row`): the same MoE model over two local rank processes with the routed
  experts split over them, and the all-to-all's share of the step; measured only where the build
  has expert parallelism (`PipelineConfig.expert_parallel`), else the row says it is not measured.

`--quick`: 4 layers, d = 128 (the same 1,024 tokens a step), fewer rounds. The load average is
recorded before and after: the ratios are paired, the absolute times are not.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import markdown_table, random_batch, run_config

SHAPE = {"vocab_size": 256, "n_layers": 8, "d_model": 256, "n_heads": 4, "seq_len": 256, "residual": "attnres",
         "block_size": 4}
QUICK_SHAPE = {**SHAPE, "n_layers": 4, "d_model": 128}
EXPERTS = {"moe_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1}
BATCH = 4  # sequences a step: 1,024 tokens at seq 256
ROUNDS = {False: (2, 12), True: (1, 4)}  # (warm-up, timed) rounds by --quick
MATMUL_ROUNDS = {False: (2, 20), True: (1, 6)}


def dense_twin(moe_cfg):
    """The dense SwiGLU ModelConfig of `moe_cfg`'s shape whose parameter count is nearest its active
    count (the count is linear in the MLP width, so the width is solved, then rounded)."""
    from attnres_pp.model import ModelConfig
    from attnres_pp.model.transformer import active_parameter_count, parameter_count

    base = {k: v for k, v in moe_cfg.to_dict().items() if not k.startswith("moe_")}

    def count(d_ff: int) -> int:
        return parameter_count(ModelConfig.from_dict({**base, "d_ff": d_ff}))

    slope = count(2) - count(1)
    d_ff = max(1, round((active_parameter_count(moe_cfg) - count(1)) / slope) + 1)
    return ModelConfig.from_dict({**base, "d_ff": d_ff})


def _engine(cfg):
    from attnres_pp.pipeline.config import PipelineConfig
    from attnres_pp.train import RunConfig, TrainConfig
    from attnres_pp.train.engines import make_engine

    train = TrainConfig(steps=10_000, batch_size=BATCH, microbatches=1, warmup_steps=0, threads=1, seed=0,
                        device="cpu", dtype="fp32")
    return make_engine(RunConfig(model=cfg, train=train, pipeline=PipelineConfig(launcher="local")))


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of `work()`. On a shared machine the CPU time is
    what the work cost (one thread: time spent descheduled is left out); the wall time is kept beside."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def paired(times: dict[str, list[float]], a: str, b: str) -> dict:
    """Median, quartiles of the within-round ratios a / b, and each side's median."""
    ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "ratio_quartiles": [quartiles[0], quartiles[2]],
            "median_s": {name: statistics.median(t) for name, t in times.items()}}


def step_times(cfgs: dict, warmup: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """{"wall" | "cpu": {config: seconds of its `train_step` per timed round}}: the configs
    alternate, their order reversed every other round, and step r of each is on the same batch."""
    engines = {name: _engine(cfg) for name, cfg in cfgs.items()}
    names = list(engines)
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    for index in range(warmup + rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            cfg = cfgs[name]
            inputs_BT, targets_BT = random_batch(index, BATCH, cfg.seq_len, cfg.vocab_size)
            wall, cpu = timed(lambda: engines[name].train_step(index, inputs_BT, targets_BT, 1e-3))  # noqa: B023
            if index >= warmup:
                times["wall"][name].append(wall)
                times["cpu"][name].append(cpu)
    for engine in engines.values():
        engine.close()
    return times


def experts_pass(x_MD, gate_up, down, counts_E: list[int], matmul, grad_MW):
    """Forward and backward of the routed experts on rows grouped by expert with `matmul`: the same
    computation as `model.moe.RoutedExperts.compute`, its matmul passed in."""
    import torch.nn.functional as F

    gate_MF, up_MF = matmul(x_MD, gate_up, counts_E).chunk(2, dim=-1)
    y_MW = matmul(F.silu(gate_MF) * up_MF, down, counts_E)
    y_MW.backward(grad_MW)
    return y_MW.detach()


def grouped_against_loop(cfg, warmup: int, rounds: int) -> dict:
    """Median seconds of one MoE layer's routed experts (forward + backward) with the grouped matmul
    and with the per-expert loop, alternating; their largest output difference."""
    import torch

    from attnres_pp.model.moe import _grouped_mm_fits, grouped_matmul, grouped_matmul_loop, route

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    n_tokens = BATCH * cfg.seq_len
    x_ND = torch.randn(n_tokens, cfg.d_model, generator=generator)
    router_ED = torch.randn(cfg.moe_experts, cfg.d_model, generator=generator) * cfg.init_std
    _affinity, expert_NK, _gate = route(cfg, x_ND, router_ED, torch.zeros(cfg.moe_experts))
    order_M = torch.argsort(expert_NK.flatten(), stable=True)
    counts_E = torch.bincount(expert_NK.flatten(), minlength=cfg.moe_experts).tolist()
    x_MD = x_ND[order_M // cfg.moe_top_k].contiguous().requires_grad_()
    gate_up = (torch.randn(cfg.moe_experts, 2 * cfg.expert_dim, cfg.d_model, generator=generator)
               * cfg.init_std).requires_grad_()
    down = (torch.randn(cfg.moe_experts, cfg.source_width, cfg.expert_dim, generator=generator)
            * cfg.init_std).requires_grad_()
    grad_MW = torch.randn(len(order_M), cfg.source_width, generator=generator)
    kinds = {"grouped": grouped_matmul, "loop": grouped_matmul_loop}
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in kinds}, "cpu": {n: [] for n in kinds}}
    outputs = {}
    for index in range(warmup + rounds):
        for name in list(kinds) if index % 2 == 0 else list(kinds)[::-1]:
            wall, cpu = timed(lambda: outputs.__setitem__(name, experts_pass(  # noqa: B023
                x_MD, gate_up, down, counts_E, kinds[name], grad_MW)))  # noqa: B023
            if index >= warmup:
                times["wall"][name].append(wall)
                times["cpu"][name].append(cpu)
            for tensor in (x_MD, gate_up, down):
                tensor.grad = None
    return {"grouped_mm_used": _grouped_mm_fits(x_MD, gate_up.transpose(1, 2)), "rows": len(order_M),
            "counts_per_expert": counts_E, "cpu": paired(times["cpu"], "loop", "grouped"),
            "wall": paired(times["wall"], "loop", "grouped"),
            "max_abs_difference": float((outputs["grouped"] - outputs["loop"]).abs().max()), "times": times}


def expert_parallel_run_config(shape: dict) -> dict:
    """The EP = 2 run: the MoE model over D = 2 local rank processes (expert parallelism takes its
    ranks along the data-parallel axis), P = 1, the same 1,024-token global batch."""
    return {"model": {**shape, **EXPERTS}, "stages": 1, "virtual": 1, "schedule": "1f1b", "microbatches": 1,
            "data_parallel": 2, "expert_parallel": 2, "launcher": "local"}


def _ep_engine(run: dict, expert_parallel: int):
    from attnres_pp.bench.common import TimedEngine

    run_cfg = run_config(run["model"], stages=run["stages"], virtual=run["virtual"], schedule=run["schedule"],
                         microbatches=run["microbatches"], microbatch_size=BATCH // run["data_parallel"],
                         launcher=run["launcher"])
    pipeline = dataclasses.replace(run_cfg.pipeline, data_parallel=run["data_parallel"],
                                   expert_parallel=expert_parallel)
    return TimedEngine(dataclasses.replace(run_cfg, pipeline=pipeline,
                                           train=dataclasses.replace(run_cfg.train, batch_size=BATCH)))


def expert_parallel_row(run: dict, warmup: int, rounds: int) -> dict:
    """The `run` (EP = 2) against the same ranks with every expert replicated (EP = 1), stepped in
    alternation: median driver wall time of a step each, the median paired ratio, and the
    all-to-all's share of the EP = 2 step (`moe_all_to_all_s`, the busiest rank's seconds in its
    dispatch and combine, over the step's wall time) with the bytes every rank sent off itself; or
    why nothing is measured in this build."""
    from attnres_pp.pipeline.config import PipelineConfig

    if "expert_parallel" not in {f.name for f in dataclasses.fields(PipelineConfig)}:
        return {"measured": False, "why": "this build has no expert parallelism (PipelineConfig.expert_parallel)"}
    engines = {"ep": _ep_engine(run, run["expert_parallel"]), "replicated": _ep_engine(run, 1)}
    try:
        for index in range(warmup + rounds):
            for name in ("ep", "replicated") if index % 2 == 0 else ("replicated", "ep"):
                engines[name].step()
    finally:
        for engine in engines.values():
            engine.close()
    samples = {name: engine.samples[warmup:] for name, engine in engines.items()}
    times = {name: [s.wall_s for s in got] for name, got in samples.items()}
    shares = [s.metrics["moe_all_to_all_s"] / s.wall_s for s in samples["ep"]]
    return {"measured": True, "run": run, **paired(times, "ep", "replicated"), "times": times,
            "all_to_all_share": statistics.median(shares),
            "all_to_all_s": statistics.median(s.metrics["moe_all_to_all_s"] for s in samples["ep"]),
            "all_to_all_bytes": samples["ep"][-1].metrics["moe_all_to_all_bytes"]}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    from attnres_pp.model import ModelConfig
    from attnres_pp.model.transformer import active_parameter_count, parameter_count

    del out_dir  # tables only
    load_before = _load_average()
    shape = QUICK_SHAPE if quick else SHAPE
    moe_cfg = ModelConfig.from_dict({**shape, **EXPERTS})
    dense_cfg = dense_twin(moe_cfg)
    warmup, rounds = ROUNDS[quick]
    progress(f"MoE (active {active_parameter_count(moe_cfg):,} of {parameter_count(moe_cfg):,}) against dense "
             f"d_ff {dense_cfg.d_ff} ({parameter_count(dense_cfg):,}): {rounds} rounds after {warmup}")
    times = step_times({"moe": moe_cfg, "dense": dense_cfg}, warmup, rounds)
    cpu, wall = paired(times["cpu"], "moe", "dense"), paired(times["wall"], "moe", "dense")
    progress(f"  MoE / dense step: CPU time {cpu['ratio']:.3f}, wall {wall['ratio']:.3f}")
    matmul = grouped_against_loop(moe_cfg, *MATMUL_ROUNDS[quick])
    progress(f"  per-expert loop / grouped matmul: CPU time {matmul['cpu']['ratio']:.3f}")
    ep = expert_parallel_row(expert_parallel_run_config(shape), warmup, rounds)
    experts_share = moe_cfg.n_moe_layers * matmul["cpu"]["median_s"]["grouped"] / cpu["median_s"]["moe"]
    return {"shape": shape, "experts": {**EXPERTS, "expert_dim": moe_cfg.expert_dim}, "batch": BATCH,
            "tokens_per_step": BATCH * moe_cfg.seq_len, "warmup_rounds": warmup, "rounds": rounds,
            "params": {"moe_total": parameter_count(moe_cfg), "moe_active": active_parameter_count(moe_cfg),
                       "dense": parameter_count(dense_cfg), "dense_d_ff": dense_cfg.d_ff,
                       "moe_dense_layers_d_ff": moe_cfg.ff_dim},
            "cpu": cpu, "wall": wall, "times": times, "moe_over_dense": cpu["ratio"], "grouped_matmul": matmul,
            "routed_experts_share_of_moe_step": experts_share,
            "expert_parallel": ep, "load_average": {"before": load_before, "after": _load_average()}}


def _load_average() -> list[float]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [round(x, 2) for x in load]


def _ratio(paired_times: dict) -> str:
    low, high = paired_times["ratio_quartiles"]
    return f"{paired_times['ratio']:.3f} ({low:.2f}-{high:.2f})"


def to_markdown(payload: dict) -> str:
    shape, experts, params = payload["shape"], payload["experts"], payload["params"]
    cpu, wall, ep, tokens = payload["cpu"], payload["wall"], payload["expert_parallel"], payload["tokens_per_step"]
    lines = ["## Mixture of experts against the dense model of equal active parameters", "",
             f"Block AttnRes (blocks of {shape['block_size']} sublayers), {shape['n_layers']} layers, d = "
             f"{shape['d_model']}, {shape['n_heads']} heads, seq {shape['seq_len']}, {payload['batch']} sequences "
             f"({tokens:,} tokens) a step, fp32, one thread. MoE: E = {experts['moe_experts']} routed experts of "
             f"width {experts['expert_dim']}, K = {experts['moe_top_k']}, S = {experts['moe_shared_experts']} "
             f"shared, in every layer; dense: SwiGLU of width {params['dense_d_ff']}, so that its parameters equal "
             "the MoE model's active ones. A step is the engine's whole train_step (forward, backward, AdamW, "
             f"bias update); the two alternate, medians of {payload['rounds']} rounds after "
             f"{payload['warmup_rounds']}. CPU = the process's CPU time (one thread: what the step cost, time "
             "descheduled by other work on the machine left out), the headline; wall beside it. Ratio = median "
             "of the within-round ratios (quartiles in brackets).", ""]
    lines.append(markdown_table(
        ["model", "parameters", "active parameters", "step CPU (ms)", "step wall (ms)", "tokens/s (CPU)",
         "over dense, CPU", "over dense, wall"],
        [["dense (single process)", f"{params['dense']:,}", f"{params['dense']:,}", 1e3 * cpu["median_s"]["dense"],
          1e3 * wall["median_s"]["dense"], tokens / cpu["median_s"]["dense"], "1", "1"],
         ["MoE (single process)", f"{params['moe_total']:,}", f"{params['moe_active']:,}",
          1e3 * cpu["median_s"]["moe"], 1e3 * wall["median_s"]["moe"], tokens / cpu["median_s"]["moe"],
          _ratio(cpu), _ratio(wall)],
         ["MoE, EP = 2", f"{params['moe_total']:,}", f"{params['moe_active']:,}", "",
          1e3 * ep["median_s"]["ep"] if ep["measured"] else "not measured", "", "", ""]]))
    return "\n".join(lines + _ep_markdown(ep) + _matmul_markdown(payload))


def _ep_markdown(ep: dict) -> list[str]:
    if not ep["measured"]:
        return ["", f"EP = 2 not measured: {ep['why']}."]
    share = ep["all_to_all_share"]
    return ["", f"EP = 2: the MoE model over D = 2 local rank processes (one thread each), the routed experts split "
                f"over them, against the same two ranks with every expert replicated (EP = 1), alternating; the "
                f"driver's wall time of a step (the ranks' CPU time is not read here): EP = 2 "
                f"{1e3 * ep['median_s']['ep']:.0f} ms, EP = 1 {1e3 * ep['median_s']['replicated']:.0f} ms, EP = 2 / "
                f"EP = 1 {_ratio(ep)}. The all-to-all's share of the EP = 2 step: {share:.1%} (the rank that "
                f"spent longest in its dispatch and combine, counts and rows, forward and backward, waits "
                f"included: {1e3 * ep['all_to_all_s']:.1f} ms of the step, median; "
                f"{ep['all_to_all_bytes']:,} bytes sent off the ranks a step)."]


def _matmul_markdown(payload: dict) -> list[str]:
    matmul = payload["grouped_matmul"]
    grouped = "torch._grouped_mm" if matmul["grouped_mm_used"] else "the loop: this build has no grouped mm"
    return ["", "### The grouped matmul against its per-expert loop (the measured fallback)", "",
            f"One MoE layer's routed experts, forward + backward on the step's {matmul['rows']:,} token-choices "
            f"grouped by expert (counts per expert {matmul['counts_per_expert']}), the two alternating; grouped = "
            f"`model.moe.grouped_matmul` ({grouped}), loop = `grouped_matmul_loop` (one matmul per expert). "
            f"Outputs differ by at most {matmul['max_abs_difference']:.2e}.", "",
            markdown_table(["", "grouped (ms)", "loop (ms)", "loop / grouped"],
                           [[clock, 1e3 * matmul[clock]["median_s"]["grouped"], 1e3 * matmul[clock]["median_s"]["loop"],
                             _ratio(matmul[clock])] for clock in ("cpu", "wall")]), "",
            f"The routed experts (grouped, all {payload['shape']['n_layers']} layers) are about "
            f"{payload['routed_experts_share_of_moe_step']:.0%} of the MoE step's CPU time.", "",
            f"Load average (1, 5, 15 min) before {payload['load_average']['before']}, after "
            f"{payload['load_average']['after']}."]
