"""`attnres-pp simulate plan`: the fastest training configuration that fits, for a model and a cluster.

Searched: T (the tensor-parallel sizes the request allows; D = GPUs / (T x P)), P (dividing the
GPUs), EP (for a mixture of experts: the powers of two dividing E and D, docs/spec.md section 12), V,
m (whole sequences per microbatch), the schedule (gpipe, 1f1b and zb_h1 at V = 1, the interleaved
ones, zbv, dualpipev, v_half and v_min; with it the placement: loop, or V-shape for the last four), the block
size (where the variant has one), the cross-stage cache (on, or off: train's `--cache off`, the naive
payloads; searched where the model has depth attention and more than one chunk), dp_shard
(replicate | fsdp, with fsdp's reshard after forward never | always) and activation checkpointing
(none | full | selective). Two stages keep it fast:
  1. every candidate is priced in closed form (`plan_rows.Planner.estimate`, computed for all of
     them at once by `plan_price.price_all`): the slowest rank's compute per microbatch times m over
     (1 - docs/spec.md section 5's closed-form bubble), plus one microbatch's hops there and back,
     plus the data-parallel collectives; memory as the exact parameter/gradient/AdamW bytes + a
     closed-form count of in-flight chunk-microbatches;
  2. the fastest candidates that pass stage 1 with slack get the exact memory walk
     (`simulator.memory`) and the event-engine simulation of their schedule with per-hop links
     (NVLink inside a node, the network between nodes: global rank = dp_rank x P + pp_rank, G per
     node); rows are those that fit, ranked by the simulated step time.
Each row carries its `attnres-pp train` command and whether train runs it on GPUs (`plan_command`);
`make_plan` also names the fastest row train runs, searching on where no top row does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from attnres_pp.simulator.metrics import closed_form_min_microbatches
from attnres_pp.simulator.plan_command import not_runnable_reason, train_command  # noqa: F401 (re-exported)
from attnres_pp.simulator.plan_costs import PlanCosts, fsdp_gathers  # noqa: F401 (re-exported)
from attnres_pp.simulator.plan_price import Pricing, price_all  # noqa: F401 (price_all re-exported)
from attnres_pp.simulator.plan_request import GIB, SPLIT, Candidate, PlanRequest  # noqa: F401 (re-exported)
from attnres_pp.simulator.plan_rows import Planner


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def block_sizes(request: PlanRequest) -> list[int]:
    cfg = request.model
    if not cfg.uses_depth_attention:
        return [cfg.block_size]
    if request.block_size is not None or cfg.blocks:  # --blocks N places the blocks alone
        return [request.block_size if request.block_size is not None else cfg.block_size]
    # Block AttnRes with 4, 8 or 16 blocks (the papers' range; more blocks = more to send and cache).
    sizes = {-(-cfg.n_sublayers // n) for n in (4, 8, 16) if n <= cfg.n_sublayers}
    return sorted(sizes)


def schedules_for(n_stages: int, n_virtual: int) -> list[str]:
    if n_stages == 1:
        return ["1f1b"] if n_virtual == 1 else []
    if n_virtual == 1:
        # GPipe only at V = 1: interleaved it has interleaved 1F1B's bubble and holds all m microbatches.
        return ["gpipe", "1f1b", "zb_h1"]
    # The V-shaped ones place exactly two chunks per rank; V-Half and V-Min trade a little bubble for
    # about a half and a third of ZB-V's activations (docs/spec.md section 5).
    v_shaped = ["zbv", "dualpipev", "v_half", "v_min"] if n_virtual == 2 else []
    return ["interleaved_1f1b", "interleaved_zb"] + v_shaped


def candidates(request: PlanRequest) -> list[Candidate]:
    cfg, found = request.model, []
    layouts = [(t, p) for t in request.legal_tp_sizes() for p in _divisors(request.gpus // t)]
    for t, n_stages in layouts:
        replicas = request.gpus // (t * n_stages)
        sp = request.sequence_parallel and t > 1
        if n_stages > cfg.n_layers or request.global_batch % replicas:
            continue
        per_replica = request.global_batch // replicas
        shards = [("replicate", "never")] + ([("fsdp", "never"), ("fsdp", "always")] if replicas > 1 else [])
        for n_virtual in (1, 2, 3, 4, 6, 8):
            if n_stages * n_virtual > cfg.n_layers:
                continue
            # With one chunk nothing is sent or cached; the standard residual has no cache to turn off.
            caches = (True, False) if cfg.uses_depth_attention and n_stages * n_virtual > 1 else (True,)
            for schedule in schedules_for(n_stages, n_virtual):
                for m in _divisors(per_replica):
                    # m >= P to fill the pipeline; the V-shaped ones need more (ZB-V 2P - 1, the others 2P).
                    if n_stages > 1 and m < max(n_stages, closed_form_min_microbatches(schedule, n_stages)):
                        continue
                    for size, cache, (shard, reshard), ac, ep in itertools.product(
                            block_sizes(request), caches, shards, ("none", "selective", "full"),
                            request.expert_parallel_sizes(replicas)):
                        found.append(Candidate(schedule, n_stages, n_virtual, m, replicas, size, shard, ac,
                                               cache, reshard, t, sp, ep))
    return found



def _gib(n_bytes: float) -> str:
    gib = n_bytes / GIB
    return f"{gib:.1f}" if gib < 10 else f"{gib:.0f}"


class Infeasible(ValueError):
    """No configuration fits: the message says what is short."""


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """`rows`: those that fit, fastest first (at most the request's top); `run`: the fastest row train
    runs on the GPUs (`runnable`), one of `rows` where one is, else found by the same search over the
    runnable candidates alone (None if none of them fits); `run_row`: its 1-based index in `rows`, or
    None where it is not among them."""

    rows: list[dict]
    run: dict | None
    run_row: int | None


def plan(request: PlanRequest, *, evaluate_at_most: int = 32) -> list[dict]:
    """Rows that fit, fastest first (at most request.top); Infeasible if none does."""
    return _plan(request, evaluate_at_most=evaluate_at_most, find_run=False).rows


def make_plan(request: PlanRequest, *, evaluate_at_most: int = 32) -> PlanResult:
    """`plan`'s rows and the fastest row train runs (`PlanResult`); Infeasible if no row fits."""
    return _plan(request, evaluate_at_most=evaluate_at_most, find_run=True)


def _plan(request: PlanRequest, *, evaluate_at_most: int, find_run: bool) -> PlanResult:
    planner = Planner(request)
    budget = request.gpu_memory_gib * GIB
    found = candidates(request)
    if not found and request.expert_parallel not in (None, 1):
        raise Infeasible(f"--expert-parallel {request.expert_parallel} divides no data-parallel degree D = GPUs / "
                         f"(T x P) of {request.gpus} GPUs that the batch allows: give an EP dividing D, or leave "
                         "it out to search")
    if not found:
        raise Infeasible(f"no layout of {request.model.n_layers} layers and a batch of {request.global_batch} "
                         f"sequences over {request.gpus} GPUs: give a batch divisible by the replicas")
    pricing = Pricing(planner, found)
    rows_by_index: dict[int, dict] = {}  # a candidate is walked once for both searches

    def row_of(index: int) -> dict:
        if index not in rows_by_index:
            rows_by_index[index] = planner.evaluate(found[index])
        return rows_by_index[index]

    evaluated, leanest = _evaluate_fastest(pricing, list(range(len(found))), budget, request.top, evaluate_at_most,
                                           row_of)
    rows = [row for row in evaluated.values() if row["peak_memory_bytes"] <= budget]
    if not rows:
        best = min((evaluated[i] for i in leanest), key=lambda r: r["peak_memory_bytes"])
        raise Infeasible(_what_is_short(request, best, fsdp_searched=any(c.dp_shard == "fsdp" for c in found)))
    rows.sort(key=lambda r: r["step_time_s"])
    rows = rows[:request.top]
    run_row = next((i for i, row in enumerate(rows, 1) if row["runnable"]), None)
    run = rows[run_row - 1] if run_row is not None else None
    if run is None and find_run:
        # The same search over the candidates train runs, for one row: as if the request held only them.
        runnable = [i for i, c in enumerate(found) if not_runnable_reason(request, c) is None]
        found_rows, _leanest = _evaluate_fastest(pricing, runnable, budget, 1, evaluate_at_most, row_of)
        fitting = sorted((row for row in found_rows.values() if row["peak_memory_bytes"] <= budget),
                         key=lambda r: r["step_time_s"])
        run = fitting[0] if fitting else None
    return PlanResult(rows=rows, run=run, run_row=run_row)


def _evaluate_fastest(pricing: Pricing, indices: list[int], budget: float, top: int, evaluate_at_most: int,
                      row_of) -> tuple[dict[int, dict], list[int]]:
    """Stage 2 over the candidates `indices` (ascending): the rows of the fastest whose estimated peak
    fits (with 25% slack: the estimate is rough) and, while fewer than `top` rows fit, of the 16 with the
    least estimated peaks; by candidate index, with those 16 (empty when not needed)."""
    chosen = set(indices) if len(indices) < len(pricing.candidates) else None
    evaluated: dict[int, dict] = {}
    hopeful = 0  # the estimated fits walked so far, fastest first
    for index in pricing.by_step:
        if chosen is not None and index not in chosen or pricing.peak(index) > 1.25 * budget:
            continue
        # Enough rows after the first `evaluate_at_most`; fewer (the estimate was too kind): go on, to a cap.
        fits = sum(1 for row in evaluated.values() if row["peak_memory_bytes"] <= budget)
        if hopeful >= evaluate_at_most and (fits >= top or hopeful >= 8 * evaluate_at_most):
            break
        evaluated[index] = row_of(index)
        hopeful += 1
    leanest: list[int] = []
    if sum(1 for row in evaluated.values() if row["peak_memory_bytes"] <= budget) < top:
        # The estimate can be too strict as well as too kind: the candidates it finds leanest, walked
        # exactly, join the rows if they fit; if none does, the least of them says what is short.
        leanest = pricing.leanest(indices, 16)
        for index in leanest:
            if index not in evaluated:
                evaluated[index] = row_of(index)
    return evaluated, leanest


def _what_is_short(request: PlanRequest, best: dict, *, fsdp_searched: bool) -> str:
    c = best["config"]
    shard = "" if fsdp_searched else " or enable fsdp (it needs D > 1)"
    return (f"needs {_gib(best['peak_memory_bytes'])} GiB per rank at best ({c['schedule']} "
            f"{'T=' + str(c['tensor_parallel']) + ' ' if c['tensor_parallel'] > 1 else ''}"
            f"{'EP=' + str(c['expert_parallel']) + ' ' if c['expert_parallel'] > 1 else ''}P={c['n_stages']} "
            f"V={c['n_virtual']} D={c['data_parallel']} {c['dp_shard']}, AC {c['activation_checkpoint']}, "
            f"{c['tokens_per_microbatch']} tokens per microbatch), over the {request.gpu_memory_gib:g} GiB given: "
            f"add GPUs{shard}")
