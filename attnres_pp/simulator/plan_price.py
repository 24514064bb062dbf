"""Stage 1 of the plan at speed: `Pricing` gives each candidate `Planner.estimate`'s (step, peak), the
same numbers, from terms each computed once for all the candidates that share them, and computes a
peak only when the search asks for it.

A search prices tens of thousands of candidates that differ in a few fields each, so every term of
the estimate is kept under the fields it reads: the busiest rank's seconds per microbatch under the
layout, tokens, T and AC; the bubble under P, V, m and the schedule; the hops under the layout and
the cache; the collectives under the layout, D, dp_shard and the reshard; the fp32 state under the
layout and dp_shard. A chunk's seconds and saved bytes read the partition only through the chunk's
layers (`project.chunk_seconds`, `memory_features`: the sublayer range, and whether it is the first
or the last chunk, which its first and last layer say), so they are kept under (first layer, layer
count): chunk 2 of 4 x 6 and chunk 2 of 8 x 3 (the same 2 layers) are priced once. The step adds the
terms in `estimate`'s order, so the floats are equal, not only close; the bytes are integers.

Sorting needs every step; the peak is needed for the candidates the search walks in step order
(until it has its rows) and for all of them only where it looks for the leanest (`plan`), so each
peak is computed on first use. tests/test_sim_plan.py holds `price_all` equal to `estimate` for
every candidate of several requests, and the plan's rows equal to those from `estimate`'s prices.
"""

from __future__ import annotations

from attnres_pp.comm.plan import shard_tokens
from attnres_pp.simulator.memory import activation_bytes
from attnres_pp.simulator.metrics import closed_form_bubble_fraction
from attnres_pp.simulator.plan_request import SPLIT, Candidate, closed_form_in_flight
from attnres_pp.simulator.plan_rows import Planner


def price_all(planner: Planner, found: list[Candidate]) -> list[tuple[float, int, Candidate]]:
    """(estimated step seconds, estimated peak bytes, candidate) of each candidate, in order: equal
    to `planner.estimate(candidate)`."""
    pricing = Pricing(planner, found)
    return [(pricing.steps[i], pricing.peak(i), candidate) for i, candidate in enumerate(found)]


class Pricing:
    """Stage 1's prices of `found` (by index): `steps` of all, `peak(i)` on first use, `by_step` the
    indices fastest first (a stable sort: ties keep the candidates' order)."""

    def __init__(self, planner: Planner, found: list[Candidate]) -> None:
        self.candidates = found
        self._pricer = _Pricer(planner)
        self.steps = [self._pricer.step(candidate) for candidate in found]
        self.by_step = sorted(range(len(found)), key=self.steps.__getitem__)
        self._peaks: dict[int, int] = {}

    def peak(self, index: int) -> int:
        if index not in self._peaks:
            self._peaks[index] = self._pricer.peak(self.candidates[index])
        return self._peaks[index]

    def leanest(self, indices: list[int], count: int) -> list[int]:
        """The `count` of `indices` with the least estimated peaks (ties in the given order)."""
        return sorted(indices, key=self.peak)[:count]


class _Pricer:
    """`Planner.estimate` with each term kept under the candidate fields it reads."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.request = planner.request
        self._terms: dict[str, dict] = {name: {} for name in (
            "busiest", "bubble", "hops", "collectives", "fixed", "saved", "chunk_time", "chunk_saved",
            "cache_unit", "first_layers")}

    def _tokens(self, c: Candidate) -> int:
        return self.request.global_batch // (c.data_parallel * c.n_microbatches) * self.request.model.seq_len

    def step(self, c: Candidate) -> float:
        """`estimate`'s step: the busiest rank's compute over (1 - bubble), the hops there and back,
        the data-parallel collectives."""
        partition, terms, m, sp = self.planner.partition(c), self._terms, c.n_microbatches, c.sp
        layout, tokens = (c.n_stages, c.n_virtual, c.block_size, partition.placement), self._tokens(c)
        key = (layout, tokens, c.tensor_parallel, sp, c.activation_checkpoint, c.expert_parallel)
        busiest = terms["busiest"].get(key)
        if busiest is None:
            busiest = terms["busiest"][key] = self._busiest(c, partition, tokens, sp)
        key = (c.n_stages, c.n_virtual, m, c.schedule)
        bubble = terms["bubble"].get(key)
        if bubble is None:
            bubble = terms["bubble"][key] = closed_form_bubble_fraction(*key)
        key = (layout, tokens, c.tensor_parallel, sp, c.cache)
        hops = terms["hops"].get(key)
        if hops is None:
            hops = terms["hops"][key] = 2 * sum(self.planner.hop_seconds(
                c, partition, self.planner.payloads(c, partition))[1])
        # fsdp's gathers a step: m + 1 a chunk under reshard always (`PlanCosts.dp_collectives`), else one.
        key = (layout, c.data_parallel, c.tensor_parallel, sp, c.dp_shard, c.reshard_after_forward,
               m if c.reshard_after_forward != "never" else 0, c.expert_parallel)
        collectives = terms["collectives"].get(key)
        if collectives is None:
            collectives = terms["collectives"][key] = self.planner.dp_collectives(c, partition)["total_s"]
        return busiest * m / (1 - bubble) + hops + collectives

    def _first_layers(self, partition) -> list[int]:
        first = self._terms["first_layers"].get(id(partition))
        if first is None:
            first = self._terms["first_layers"][id(partition)] = [
                sum(partition.layers_per_chunk[:chunk]) for chunk in range(partition.n_chunks)]
        return first

    def _busiest(self, c: Candidate, partition, tokens: int, sp: bool) -> float:
        """The largest per-rank sum of forward + backward seconds of one microbatch, summed in chunk order;
        a chunk's forward, memory-bound and tp seconds are kept under its layers (AC reads none of them)."""
        owners, _rank_chunks = self.planner.layout(partition)
        first, memo = self._first_layers(partition), self._terms["chunk_time"]
        per_rank = [0.0] * c.n_stages
        # The all-to-alls read EP and how far apart its ranks are (P x T global ranks).
        experts = (c.expert_parallel, c.n_stages) if c.expert_parallel > 1 else 1
        for chunk in range(partition.n_chunks):
            key = (first[chunk], partition.layers_per_chunk[chunk], c.block_size, tokens, c.tensor_parallel, sp,
                   experts)
            seconds = memo.get(key)
            if seconds is None:
                seconds = memo[key] = (*self.planner.chunk_forward(c, partition, chunk),
                                       self.planner.chunk_tp(c, partition, chunk))
            forward, backward = self.planner.directions(c, *seconds)
            per_rank[owners[chunk]] += forward + backward
        return max(per_rank)

    def peak(self, c: Candidate) -> int:
        """`estimate`'s peak: the fullest rank's fp32 state, the in-flight chunk-microbatches, one
        recomputation, the W store under a split schedule, the cache."""
        partition, terms, m, n_stages = self.planner.partition(c), self._terms, c.n_microbatches, c.n_stages
        layout, tokens = (n_stages, c.n_virtual, c.block_size, partition.placement), self._tokens(c)
        key = (layout, c.data_parallel, c.dp_shard, c.tensor_parallel, c.expert_parallel)
        fixed = terms["fixed"].get(key)
        if fixed is None:
            fixed = terms["fixed"][key] = max(self.planner.fixed_bytes(c, partition))
        copies, sp = not (c.dp_shard == "fsdp" and c.data_parallel > 1), c.sp
        key = (layout, tokens, c.activation_checkpoint, copies, c.tensor_parallel, sp, c.expert_parallel)
        saved = terms["saved"].get(key)
        if saved is None:
            saved = terms["saved"][key] = self._saved_terms(c, partition, tokens, copies, sp)
        rank_pairs, n_first, recomputed_split, recomputed, kept = saved
        in_flight = closed_form_in_flight(c.schedule, n_stages, m, n_first)
        held = max(in_flight * most + last for most, last in rank_pairs)
        split = c.schedule in SPLIT
        cache = 0
        if n_first > 1 and c.cache:
            key = (c.block_size, tokens, c.tensor_parallel, sp)
            unit = terms["cache_unit"].get(key)
            if unit is None:
                cfg = self.planner.model_for(c)
                unit = terms["cache_unit"][key] = 2 * cfg.n_blocks * shard_tokens(tokens, c.tensor_parallel, sp) \
                    * cfg.source_width * self.planner.element
            cache = unit * min(m, n_stages)
        return (fixed + held + (recomputed_split if split else recomputed) + (n_stages * kept if split else 0)
                + cache)

    def _saved_terms(self, c: Candidate, partition, tokens: int, copies: bool, sp: bool) -> tuple:
        """What `estimate` reads of the chunks' saved bytes: per rank (the largest of its chunks but the
        last, the last's if it holds it), rank 0's chunk count, the largest recomputation with and
        without I's, the largest W store."""
        _owners, rank_chunks = self.planner.layout(partition)
        first, memo = self._first_layers(partition), self._terms["chunk_saved"]
        saved = []
        for chunk in range(partition.n_chunks):
            key = (first[chunk], partition.layers_per_chunk[chunk], c.block_size, tokens, c.activation_checkpoint,
                   copies, c.tensor_parallel, sp, c.expert_parallel)
            if key not in memo:
                memo[key] = activation_bytes(
                    self.planner.model_for(c), partition, chunk, tokens=tokens, dtype=self.request.dtype,
                    activation_checkpoint=c.activation_checkpoint, weight_copies=copies,
                    attention_kernel=self.request.attention_kernel, tensor_parallel=c.tensor_parallel,
                    sequence_parallel=sp, expert_parallel=c.expert_parallel)
            saved.append(memo[key])
        last = partition.n_chunks - 1
        rank_pairs = {(max((saved[k].saved for k in chunks if k != last), default=0),
                       saved[last].saved if last in chunks else 0) for chunks in rank_chunks}
        return (tuple(rank_pairs), len(rank_chunks[0]), max(s.transient + s.input_transient for s in saved),
                max(s.transient for s in saved), max(s.stored for s in saved))
