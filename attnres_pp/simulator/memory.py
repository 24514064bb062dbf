"""Per-rank memory of a training step, predicted from shapes and the schedule's action order
(docs/spec.md section 8), with the keys a run counts in `summary.json`'s `memory_per_rank` (RSS excluded).

    param_bytes       fp32 master weights of the rank's chunks, by parameter shape (the module list
                      of `model.transformer` / `pipeline.chunk`; MSAR's stream convolutions on every
                      rank); under FSDP2 over D replicas ceil(dim0 / D) rows of each parameter but
                      those convolutions and 0-d scalars, which stay whole
    grad_bytes        the same shapes (fp32 gradients, sharded alike)
    optimizer_bytes   AdamW's two moments exp_avg and exp_avg_sq (fp32, sharded alike), as docs/spec.md section 8
                      and the runtime's count define it (its 0-d `step` tensors, 4 bytes each, left out)
    activation_peak   the peak over the rank's action order of the bytes saved for backward, as the
                      runtime's meter counts them (`pipeline.memory_meter`, the moments inside an
                      action included): F(c, mb) adds chunk c's saved bytes, B frees them; I frees
                      them too but leaves the W store (each linear layer's input and output
                      gradient, `stored_bytes`), which W frees (chunk 0's I has no inputs: its W is
                      the whole backward). Under activation checkpointing a backward recomputes
                      layers (a transient inside B or I, gone with it). Under FSDP2 the
                      all-gathered parameters that the forwards save count from the chunk's first F to
                      its last backward (one storage each, whatever the microbatch)
    cache_peak        entries put by F(c) live until the rank's last chunk's forward frees them; a
                      gradient deposit lives from the I/B of the rank's last chunk (the first backward
                      of that microbatch on the rank) until the I/B of the chunk that put the entry
    transport_buffer_bytes
                      the receive slots a shared-memory transport maps for the whole step (`--launcher
                      local` and `ray` on one host, `comm.shm_transport`): one slot per message the rank
                      receives from another rank in a step, its tensors' elements rounded up to 64, in
                      the hop dtype; not a saved tensor (a kept received hop is a view of its slot, which
                      the activation term counts too), 0 under the in-process launcher (`launcher`)
The moment of a rank's peak is that of activations + cache together (not the sum of their peaks);
the peak adds the held terms and the transport's slots, alive through the whole step.

Its parts: `memory_setup` (MemorySetup and the choices it allows), `memory_state` (parameter shapes:
param, grad, optimizer and FSDP2's gathered bytes), `memory_activation` (a chunk's bytes per
microbatch: `memory_units.json`, per variant and dtype and per checkpointing policy a linear form in
the shape features of `simulator.memory_features`, fitted to the runtime's meter on tiny chunks by
`attnres_lab.memory_units`: without checkpointing what F saves; under `full` and `selective` also the peak
inside B, the peak inside I and what I keeps until W, `ChunkActivation`) and `memory_walk` (the walk
over a rank's action order). This module puts them together per rank (`predict_ranks`), counts the
shared-memory transport's slots, and re-exports the parts' names. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from attnres_pp.comm.partition import Partition
from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.weight_store_rule import GRADIENTS
from attnres_pp.simulator.memory_activation import (  # noqa: F401 (re-exported)
    CHECKPOINT_TARGETS,
    UNITS_PATH,
    ChunkActivation,
    activation_bytes,
    attention_correction,
    flash_attention_saved,
    held_blocks,
    input_peak_bytes,
    load_units,
    math_attention_saved,
    shared_cache_bytes,
    store_bytes_per_layer,
    stored_bytes,
    units_key,
)
from attnres_pp.simulator.memory_features import (  # noqa: F401 (re-exported: attnres_lab.memory_units, tests)
    CHECKPOINT_FEATURES,
    FEATURES,
    activation_features,
    checkpoint_features,
    depth_segments,
    matmul_parameters,
    recompute_passes,
)
from attnres_pp.simulator.memory_setup import (  # noqa: F401 (re-exported)
    AC_POLICIES,
    ATTENTION_KERNELS,
    DP_SHARDS,
    DTYPE_BYTES,
    LAUNCHERS,
    MEMORY_KEYS,
    RESHARD_AFTER_FORWARD,
    SLOT_ALIGN_ELEMENTS,
    SLOT_LAUNCHERS,
    MemorySetup,
)
from attnres_pp.simulator.memory_state import (  # noqa: F401 (re-exported)
    chunk_gathered_bytes,
    gathered_parameter_bytes,
    local_numel,
    rank_moe_shapes,
    rank_parameter_shapes,
    rank_state_bytes,
    saved_parameter_shapes,
    shard_numel,
    state_bytes,
    tied_parameter_shapes,
)
from attnres_pp.simulator.memory_walk import RankMemory, walk_rank, walk_rank_gathered  # noqa: F401 (re-exported)

# ---- the shared-memory transport's receive slots ----

def transport_slot_bytes(schedule, plan: PayloadPlan, pp_rank: int, *, tokens: int, cfg: ModelConfig,
                         dtype: str) -> int:
    """Bytes of the receive slots rank `pp_rank` maps for the step (`comm.shm_transport._layout`):
    per message it receives from another rank (a hop whose sending chunk is on another rank), the
    hop's tensors (`pipeline.routes`: the chunk's received sources forward, its sent ones' gradients
    backward; [tokens, width] each, the residual's width for the standard stream) in one slot,
    rounded up to 64 elements, in the hop dtype."""
    from attnres_pp.comm.plan import RESIDUAL

    def width(source) -> int:
        return cfg.d_model if source == RESIDUAL else cfg.source_width

    # The compute order names the messages (the comm actions a lowered schedule adds match them):
    # F(c) receives chunk c - 1's hop, a backward (B or I) of c the gradients of the hop c sent.
    last = plan.partition.n_chunks - 1
    total = 0
    for action in schedule.rank_actions[pp_rank]:
        kind, c = action.kind.value, action.chunk_index
        if kind == "F" and c > 0 and schedule.rank_of(c - 1) != pp_rank:
            sources = plan.chunks[c].received
        elif kind in ("B", "I") and c < last and schedule.rank_of(c + 1) != pp_rank:
            sources = plan.chunks[c].sent
        else:
            continue
        numel = sum(tokens * width(s) for s in sources)
        total += -(-numel // SLOT_ALIGN_ELEMENTS) * SLOT_ALIGN_ELEMENTS
    return total * DTYPE_BYTES[dtype]




def dominant_term(terms: dict[str, int]) -> str:
    """The largest of the terms, by its short name (params, grads, optimizer, activations, cache)."""
    names = {"param_bytes": "params", "grad_bytes": "grads", "optimizer_bytes": "optimizer",
             "activation_peak_bytes": "activations", "cache_peak_bytes": "cache"}
    return names[max(MEMORY_KEYS, key=lambda key: terms[key])]


def predict_ranks(cfg: ModelConfig, setup: MemorySetup, schedule, partition: Partition,
                  plan: PayloadPlan | None, *, dp_ranks: range | None = None) -> list[RankMemory]:
    """One RankMemory per global rank (dp_rank * P + pp_rank) for a built schedule and plan; only
    the replicas `dp_ranks` if given (replica 0 holds the most: FSDP2's first shards are full)."""
    from attnres_pp.comm.plan import shard_tokens

    copies = not (setup.dp_shard == "fsdp" and setup.data_parallel > 1)
    t, ep = setup.tensor_parallel, setup.expert_parallel
    # At D = EP FSDP2 leaves the expert slices whole in fp32: bf16 autocast casts them every forward.
    expert_copies = copies or 1 < ep == setup.data_parallel
    saved = [activation_bytes(cfg, partition, c, tokens=setup.tokens, dtype=setup.dtype,
                              activation_checkpoint=setup.activation_checkpoint, weight_copies=copies,
                              attention_kernel=setup.attention_kernel, tensor_parallel=t,
                              sequence_parallel=setup.sp, expert_parallel=ep, expert_weight_copies=expert_copies,
                              rows_factor=setup.moe_load_factor if ep > 1 else 1.0)
             for c in range(partition.n_chunks)]
    uses_cache = plan is not None and plan.mode == "cached"
    # A cache entry or deposit is the rank's sequence shard under SP (docs/spec.md section 10).
    tensor_bytes = shard_tokens(setup.tokens, t, setup.sp) * cfg.source_width * DTYPE_BYTES[setup.dtype]
    if uses_cache and setup.activation_checkpoint != "none":
        # The gradient store keeps the frames' inputs until W: the shared entries are in it too.
        saved = [_less_shared(unit, shared_cache_bytes(cfg, partition, plan, c, schedule, tensor_bytes=tensor_bytes))
                 for c, unit in enumerate(saved)]
    fsdp = setup.dp_shard == "fsdp" and setup.data_parallel > 1
    resident = [gathered_parameter_bytes(cfg, partition, c, data_parallel=setup.data_parallel, dtype=setup.dtype,
                                         tensor_parallel=t, expert_parallel=ep)
                for c in range(partition.n_chunks)] if fsdp else None
    always = fsdp and setup.reshard_after_forward == "always"
    copies_by_chunk = [chunk_gathered_bytes(cfg, partition, c, dtype=setup.dtype, tensor_parallel=t,
                                            expert_parallel=ep, data_parallel=setup.data_parallel)
                       for c in range(partition.n_chunks)] if fsdp else None
    gathered = copies_by_chunk if always else None
    # The slots' shapes are the hops' (the whole microbatch: the shared-memory transport is not
    # modelled under tensor parallelism, whose ranks keep their sequence shard).
    slots = [transport_slot_bytes(schedule, plan, pp_rank, tokens=setup.tokens, cfg=cfg, dtype=setup.dtype)
             if setup.launcher in SLOT_LAUNCHERS and setup.n_stages > 1 and plan is not None else 0
             for pp_rank in range(setup.n_stages)]
    walks = [walk_rank_gathered(schedule.rank_actions[pp_rank], saved_by_chunk=saved,
                                plan=plan if uses_cache else None, tensor_bytes=tensor_bytes,
                                resident_by_chunk=resident, gathered_by_chunk=gathered)
             for pp_rank in range(setup.n_stages)]
    ranks = []
    for dp_rank in dp_ranks if dp_ranks is not None else range(setup.data_parallel):
        for pp_rank, (act_peak, cache_peak, peak, action, gathered_at_peak) in enumerate(walks):
            terms = rank_state_bytes(cfg, partition, pp_rank, data_parallel=setup.data_parallel,
                                     dp_shard=setup.dp_shard, dp_rank=dp_rank, tensor_parallel=t, expert_parallel=ep)
            terms.update(activation_peak_bytes=act_peak, cache_peak_bytes=cache_peak,
                         transport_buffer_bytes=slots[pp_rank])
            fixed = terms["param_bytes"] + terms["grad_bytes"] + terms["optimizer_bytes"] + slots[pp_rank]
            if fsdp and not always:
                # FSDP2 without resharding after forward (the pipeline default) keeps every parameter
                # all-gathered in the compute dtype through the step: part of the peak, not of
                # param_bytes (the activation term counts the saved ones while graphs hold them);
                # each unit's padded buffers, less what stays whole (`chunk_gathered_bytes`).
                gathered_at_peak = sum(copies_by_chunk[c] for c in partition.chunks_of(pp_rank))
                fixed += gathered_at_peak
            # Resharding always: the walk's peak holds the chunks unsharded at its moment (gathered_at_peak).
            ranks.append(RankMemory(terms=terms, peak_bytes=fixed + peak, peak_action=action,
                                    dominant=dominant_term(terms), gathered_bytes=gathered_at_peak))
    return ranks


def _less_shared(unit: ChunkActivation, shared: int) -> ChunkActivation:
    if unit.store != GRADIENTS:
        return replace(unit, saved=max(0, unit.saved - shared))
    return replace(unit, saved=max(0, unit.saved - shared), stored=max(0, unit.stored - shared),
                   input_kept=max(0, unit.input_kept - shared))


def predict_memory(cfg: ModelConfig, setup: MemorySetup) -> list[RankMemory]:
    """Build the schedule, partition and payload plan `setup` names and predict every rank."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.schedule.schedules import build_schedule, schedule_placement
    from attnres_pp.simulator.moe import check_expert_parallel

    check_expert_parallel(cfg, setup.expert_parallel, setup.data_parallel, setup.tensor_parallel)
    schedule = build_schedule(setup.schedule, setup.n_stages, setup.n_virtual, setup.n_microbatches)
    partition = make_partition(cfg.n_layers, setup.n_stages, setup.n_virtual, setup.layer_counts,
                               placement=schedule_placement(setup.schedule))
    plan = plan_for_model(cfg, partition, setup.cache)
    return predict_ranks(cfg, setup, schedule, partition, plan)
