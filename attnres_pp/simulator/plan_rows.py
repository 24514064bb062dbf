"""The two prices of a candidate: `Planner.estimate`, closed form (the slowest rank's compute per
microbatch times m over (1 - docs/spec.md section 5's closed-form bubble), one microbatch's hops there
and back, the data-parallel collectives; the exact fp32 state + a closed-form count of in-flight
chunk-microbatches), and `Planner.evaluate`, the row of the plan: the exact memory walk
(`simulator.memory`) and the event-engine simulation of its schedule with per-hop links. `explain`
splits a row into its memory and time terms (`simulate plan --why`)."""

from __future__ import annotations

import dataclasses

from attnres_pp.comm.partition import tied_copy_ranks
from attnres_pp.comm.plan import shard_tokens
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.costs import CostModel, sublayer_forward_flops
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.memory import MemorySetup, predict_ranks
from attnres_pp.simulator.metrics import closed_form_bubble_fraction
from attnres_pp.simulator.moe import all_to_all_bytes
from attnres_pp.simulator.plan_command import command_fields
from attnres_pp.simulator.plan_costs import PlanCosts, fsdp_gathers
from attnres_pp.simulator.plan_request import SPLIT, Candidate, closed_form_in_flight


class Planner(PlanCosts):
    """Prices candidates of one request (`PlanCosts` holds what they share)."""

    def estimate(self, candidate: Candidate) -> tuple[float, float]:
        """(closed-form step seconds, estimated peak bytes of the fullest rank). Under fsdp the whole
        gathered copy is counted whatever the reshard (an upper bound for `always`, which the walk prices)."""
        partition = self.chunk_costs(candidate)[0]
        forward, backward = self.chunk_times(candidate)
        owners, rank_chunks = self.layout(partition)
        per_rank = [0.0] * candidate.n_stages
        for c, (f, b) in enumerate(zip(forward, backward, strict=True)):
            per_rank[owners[c]] += f + b
        bubble = closed_form_bubble_fraction(candidate.n_stages, candidate.n_virtual, candidate.n_microbatches,
                                             candidate.schedule)
        # One microbatch's way through every hop and back is on the critical path (fill and drain).
        _wire, hops, _tensor = self.hop_seconds(candidate, partition, self.payloads(candidate, partition))
        step = (max(per_rank) * candidate.n_microbatches / (1 - bubble) + 2 * sum(hops)
                + self.dp_collectives(candidate, partition)["total_s"])
        cfg = self.model_for(candidate)
        tokens = self.tokens(candidate)
        saved = self.saved(candidate, partition)
        # Rank 0 holds the most microbatches in flight: P (1F1B-like), about (V + 1) P chunk-microbatches
        # interleaved, 2P chunk passes under ZB-V; a split schedule's W can keep up to P more; GPipe all m.
        chunks0 = rank_chunks[0]
        in_flight = closed_form_in_flight(candidate.schedule, candidate.n_stages, candidate.n_microbatches,
                                          len(chunks0))
        # One recomputation at a time; under a split schedule the W store that I leaves stays until
        # W, for up to P chunk-microbatches.
        recomputed = max(s.transient + (s.input_transient if candidate.schedule in SPLIT else 0) for s in saved)
        kept_until_w = candidate.n_stages * max(s.stored for s in saved) if candidate.schedule in SPLIT else 0
        tensor = shard_tokens(tokens, candidate.tensor_parallel, candidate.sp) * cfg.source_width * self.element
        cache = 2 * cfg.n_blocks * tensor * min(candidate.n_microbatches, candidate.n_stages) \
            if len(chunks0) > 1 and candidate.cache else 0
        # The last chunk (the head's logits) runs its backward right after its forward: one in flight.
        last = partition.n_chunks - 1
        held = max(in_flight * max((saved[c].saved for c in chunks if c != last), default=0)
                   + (saved[last].saved if last in chunks else 0) for chunks in rank_chunks)
        peak = max(self.fixed_bytes(candidate, partition)) + held + recomputed + kept_until_w + cache
        return step, peak

    def _walk(self, candidate: Candidate):
        """Everything a row is made of: (row, the fullest rank's RankMemory, its pp rank, the simulation,
        the cost model, the schedule, the data-parallel collectives)."""
        request = self.request
        partition = self.chunk_costs(candidate)[0]
        forward, backward = self.chunk_times(candidate)
        cfg, tokens = self.model_for(candidate), self.tokens(candidate)
        schedule = self.schedule(candidate)
        plan = self.payloads(candidate, partition)
        setup = MemorySetup(schedule=candidate.schedule, n_stages=candidate.n_stages, n_virtual=candidate.n_virtual,
                            n_microbatches=candidate.n_microbatches, tokens=tokens, dtype=request.dtype,
                            cache=candidate.cache, data_parallel=candidate.data_parallel,
                            dp_shard=candidate.dp_shard, activation_checkpoint=candidate.activation_checkpoint,
                            attention_kernel=request.attention_kernel, tensor_parallel=candidate.tensor_parallel,
                            sequence_parallel=candidate.sp, expert_parallel=candidate.expert_parallel,
                            reshard_after_forward=candidate.reshard_after_forward if candidate.dp_shard == "fsdp"
                            else "never")
        # Reshard after forward always: the walk holds a chunk's gathered copy only while it is unsharded.
        ranks = predict_ranks(cfg, setup, schedule, partition, plan, dp_ranks=range(1))
        wire, hops, tensor_bytes = self.hop_seconds(candidate, partition, plan)
        costs = CostModel(forward_s=tuple(forward), backward_s=tuple(backward), hop_fwd_s=tuple(hops),
                          hop_bwd_s=tuple(hops), wire_fwd_s=tuple(wire), wire_bwd_s=tuple(wire), label="plan")
        result = simulate(schedule, costs)
        collectives = self.dp_collectives(candidate, partition, fsdp_gathers(schedule, candidate))
        step = result.makespan + collectives["total_s"]
        flops = 3 * request.global_batch * sum(sublayer_forward_flops(cfg, s, cfg.seq_len)
                                               for s in range(cfg.n_sublayers))
        flops += 3 * 2.0 * request.global_batch * cfg.seq_len * cfg.d_model * cfg.vocab_size
        fullest_rank = max(range(len(ranks)), key=lambda r: ranks[r].peak_bytes)
        fullest = ranks[fullest_rank]
        row = {
            "expert_parallel": candidate.expert_parallel,
            "config": dataclasses.asdict(candidate) | {"placement": partition.placement,
                                                       "tokens_per_microbatch": tokens, "blocks": cfg.blocks},
            "step_time_s": step,
            "pipeline_s": result.makespan,
            "dp_collectives": collectives,
            "tokens_per_s_per_gpu": request.global_batch * cfg.seq_len / step / request.gpus,
            "mfu": flops / (step * request.gpus * request.peak_tflops * 1e12),
            "bubble_fraction": 1 - sum(result.compute_s) / (candidate.n_stages * result.makespan),
            "payload_mode": plan.mode,
            "bytes_per_hop": max(plan.fwd_hop_tensors, default=0) * tensor_bytes,  # per tp rank's pair
            "peak_memory_bytes": fullest.peak_bytes,
            "peak_memory_per_rank": [r.peak_bytes for r in ranks],
            "dominated_by": fullest.dominant,
            "peak_action": fullest.peak_action,
            **command_fields(request, candidate),
        }
        if cfg.moe:
            row["moe_all_to_all"] = self.all_to_all_terms(candidate, partition)
        return row, fullest, fullest_rank, result, costs, schedule, collectives

    def all_to_all_terms(self, candidate: Candidate, partition) -> dict:
        """An MoE row's dispatch and combine (docs/spec.md section 12): bytes per MoE layer and
        microbatch in each direction (the backward moves the same again), the share that leaves the
        rank, and the seconds a step the busiest rank spends in them (forward, backward, full AC's
        recomputation)."""
        moved = all_to_all_bytes(self.model_for(candidate), tokens=self.tokens(candidate),
                                 expert_parallel=candidate.expert_parallel, dtype=self.request.dtype)
        recompute = 2 if candidate.activation_checkpoint == "full" else 1
        seconds = max(candidate.n_microbatches * sum((1 + recompute) * self.chunk_all_to_all(candidate, partition, c)
                                                     for c in partition.chunks_of(rank))
                      for rank in range(candidate.n_stages))
        return {"dispatch_bytes_per_layer_and_microbatch": moved.dispatch_bytes,
                "combine_bytes_per_layer_and_microbatch": moved.combine_bytes,
                "off_rank_share": moved.off_rank_share, "seconds_per_step": seconds}

    def schedule(self, candidate: Candidate):
        """The candidate's schedule, built once for every candidate that runs it."""
        key = (candidate.schedule, candidate.n_stages, candidate.n_virtual, candidate.n_microbatches)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(*key)
        return self._schedules[key]

    def evaluate(self, candidate: Candidate) -> dict:
        """The exact memory walk and the simulated step of one candidate: a row of the plan."""
        return self._walk(candidate)[0]

    def explain(self, candidate: Candidate) -> dict:
        """The row of `candidate` and the terms of its estimate: `memory` (label, bytes) summing to
        peak_memory_bytes, `time` (label, seconds) summing to step_time_s.

        Time: the busiest rank's compute, the idle time the schedule adds with free hops (bubble), what
        the hops add over that (a second simulation with free hops), and the collectives. Memory: the
        fullest rank's fp32 state, fsdp's gathered parameters, the activation and cache peaks, less what
        those two peaks overcount by not falling on one moment (and the saved gathered parameters)."""
        row, fullest, pp_rank, result, costs, schedule, collectives = self._walk(candidate)
        free = dataclasses.replace(costs, hop_fwd_s=(0.0,) * len(costs.hop_fwd_s),
                                   hop_bwd_s=(0.0,) * len(costs.hop_bwd_s), wire_fwd_s=(), wire_bwd_s=())
        without_hops = simulate(schedule, free).makespan
        busiest = max(range(candidate.n_stages), key=lambda r: result.compute_s[r])
        compute = result.compute_s[busiest]
        partition = self.chunk_costs(candidate)[0]
        tp = self.tp_seconds(candidate, partition)
        recompute = 2 if candidate.activation_checkpoint == "full" else 1
        tp_s = candidate.n_microbatches * sum((1 + recompute) * tp[c] for c in partition.chunks_of(busiest))
        a2a_s = candidate.n_microbatches * sum((1 + recompute) * self.chunk_all_to_all(candidate, partition, c)
                                               for c in partition.chunks_of(busiest))
        # The tp and EP terms appear on rows with T > 1 or EP > 1 only (else they are zero).
        tp_terms = [(f"tp collectives (T={candidate.tensor_parallel}, SP {'on' if candidate.sp else 'off'}, "
                     "busiest rank)", tp_s - a2a_s)] if candidate.tensor_parallel > 1 else []
        if candidate.expert_parallel > 1:
            tp_terms.append((f"MoE all-to-alls (EP={candidate.expert_parallel}, dispatch and combine, busiest rank)",
                             a2a_s))
        time_terms = [("compute (busiest rank" + (", collectives apart)" if tp_terms else ")"), compute - tp_s),
                      *tp_terms,
                      ("bubble (its idle, free hops)", without_hops - compute),
                      ("pipeline hops", result.makespan - without_hops),
                      ("data-parallel all-reduce", collectives["all_reduce_s"]),
                      (f"data-parallel all-gather (x{collectives['all_gathers']})", collectives["all_gather_s"]),
                      ("data-parallel reduce-scatter", collectives["reduce_scatter_s"])]
        if candidate.tensor_parallel > 1:
            time_terms.append(("tp all-reduce of replicated gradients (SP)", collectives["tp_all_reduce_s"]))
        if tied_copy_ranks(self.model_for(candidate).tie_embeddings, partition):
            time_terms.append(("embedding group all-reduce (tied copies, first and last rank)",
                               collectives["embed_all_reduce_s"]))
        terms = fullest.terms
        gathered = fullest.gathered_bytes  # fsdp: the whole copy (never), the chunks unsharded at the peak (always)
        memory_terms = [("parameters (fp32)", terms["param_bytes"]), ("gradients (fp32)", terms["grad_bytes"]),
                        ("optimizer state (AdamW)", terms["optimizer_bytes"]),
                        ("gathered parameters (fsdp)", gathered),
                        ("activation peak", terms["activation_peak_bytes"]), ("cache peak", terms["cache_peak_bytes"])]
        # The two peaks need not fall on one moment, and under fsdp the activation peak counts the
        # saved gathered parameters that the gathered term holds already.
        memory_terms.append(("counted twice (peaks apart, fsdp saved)",
                             fullest.peak_bytes - sum(v for _k, v in memory_terms)))
        return {"row": row, "pp_rank": pp_rank, "memory": memory_terms, "time": time_terms}
