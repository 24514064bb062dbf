"""`simulator.memory` under activation checkpointing and FSDP2: the checkpointing units against the
runtime's meter on chunks they were not fitted on, and the walk's rules for recomputation (inside B,
I's kept until W, chunk 0's W) and for the all-gathered parameters, against hand counts."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest
import torch

from attnres_lab.memory_units import VARIANTS, checkpoint_bytes, random_case
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import build_rank_model
from attnres_pp.simulator.memory import (
    CHECKPOINT_FEATURES,
    CHECKPOINT_TARGETS,
    ChunkActivation,
    activation_bytes,
    gathered_parameter_bytes,
    load_units,
    saved_parameter_shapes,
    units_key,
    walk_rank,
)


class _A:
    def __init__(self, text: str) -> None:
        from attnres_pp.schedule.ir import Action

        action = Action.parse(text)
        self.kind, self.chunk_index, self.microbatch_index = action.kind, action.chunk_index, action.microbatch_index


def test_checkpoint_units_are_in_the_file_for_every_variant_and_policy():
    units = load_units()
    assert units["checkpoint_features"] == list(CHECKPOINT_FEATURES)
    assert "out_of_sample" in units
    for residual, key_mode in VARIANTS:
        cfg = ModelConfig(residual=residual, key_mode=key_mode)
        for dtype in ("fp32", "bf16"):
            for policy in ("full", "selective"):
                entry = units["checkpoint_units"][f"{policy}/{units_key(cfg, dtype)}"]
                assert set(entry["coefficients"]) == set(CHECKPOINT_TARGETS)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("residual,key_mode", VARIANTS)
def test_checkpoint_units_predict_unseen_chunks(residual, key_mode, policy):
    """Held out: another seed and every size doubled beyond the fitted grid; each target's error is
    relative to the most the chunk's microbatch holds (saved + the larger of B's peak and I's kept)."""
    torch.set_num_threads(1)
    dtype = "bf16" if residual in ("attnres", "msar") and policy == "full" else "fp32"
    rng = random.Random(f"held-out/{policy}/{residual}/{key_mode}/{dtype}")
    errors = []
    for _ in range(3):
        case = random_case(rng, residual, key_mode, scale=2)
        cfg = case["cfg"]
        partition = make_partition(cfg.n_layers, case["n_stages"], case["n_virtual"])
        measured = checkpoint_bytes(cfg, partition, case["chunk"], n_sequences=case["n_sequences"], dtype=dtype,
                                    policy=policy)
        predicted = activation_bytes(cfg, partition, case["chunk"], tokens=case["n_sequences"] * cfg.seq_len,
                                     dtype=dtype, activation_checkpoint=policy)
        most = measured["saved"] + max(measured["transient"], measured["input_kept"])
        errors += [abs(getattr(predicted, target) - measured[target]) / most for target in CHECKPOINT_TARGETS]
    assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, errors


def test_walk_counts_recomputation_inside_b_and_i_and_the_store_until_w():
    chunks = [ChunkActivation(saved=10, transient=50), ChunkActivation(saved=10, transient=40, input_transient=70,
                                                                      input_kept=60, stored=60)]
    # Fused backward: the recomputation is alive inside B only, and the activation peak includes it.
    actions = [_A(a) for a in ("F1.0", "F1.1", "B1.0", "B1.1")]
    assert walk_rank(actions, saved_by_chunk=chunks, plan=None, tensor_bytes=1) == (60, 0, 60, "B1.0")
    # Split: I peaks early as B does (the recomputation, 40) or late once the store (60) replaced
    # what F saved (10), plus what it exceeds both by (70): 20 + 50 + 70 inside I1.0, which leaves
    # 20 - 10 + 60; I1.1 peaks at 70 + 50 + 70.
    actions = [_A(a) for a in ("F1.0", "F1.1", "I1.0", "I1.1", "W1.0", "W1.1")]
    assert walk_rank(actions, saved_by_chunk=chunks, plan=None, tensor_bytes=1) == (190, 0, 190, "I1.1")
    # The early peak where it is the larger.
    early = [chunks[0], ChunkActivation(saved=10, transient=90, input_transient=0, stored=5)]
    assert walk_rank(actions, saved_by_chunk=early, plan=None, tensor_bytes=1)[0] == 20 + 90
    actions = [_A(a) for a in ("F0.0", "I0.0", "W0.0")]
    assert walk_rank(actions, saved_by_chunk=chunks, plan=None, tensor_bytes=1) == (60, 0, 60, "W0.0")


def test_walk_holds_gathered_parameters_from_first_forward_to_last_backward():
    chunks = [ChunkActivation(saved=10), ChunkActivation(saved=10)]
    actions = [_A(a) for a in ("F0.0", "F1.0", "F0.1", "B1.0", "B0.0", "F1.1", "B1.1", "B0.1")]
    peaks = walk_rank(actions, saved_by_chunk=chunks, plan=None, tensor_bytes=1, resident_by_chunk=[100, 1000])
    # Both chunks' parameters and three microbatch-chunks alive after F0.1; the peak of activations
    # and cache together leaves the parameters to the caller (they are held the whole step).
    assert peaks == (1130, 0, 30, "F0.1")


def test_saved_parameter_shapes_are_the_ones_a_forward_saves():
    """The chunk's parameters whose storages autograd saves, found by an outer saved-tensor hook."""
    torch.set_num_threads(1)
    for residual, gain in (("standard", False), ("attnres", False), ("lr_attnres", False), ("attnres", True),
                           ("lr_attnres", True)):
        cfg = ModelConfig(vocab_size=40, n_layers=2, d_model=16, n_heads=2, seq_len=8, residual=residual,
                          block_size=2, key_rank=4, key_norm_gain=gain)
        partition = make_partition(2, 1, 1)
        _model, chunks = build_rank_model(cfg, partition, 0, seed=0)
        chunk = chunks[0]
        params = {p.untyped_storage().data_ptr(): p for p in chunk.parameters()}
        saved = {}

        def pack(t, params=params, saved=saved):
            key = t.untyped_storage().data_ptr()
            if key in params:
                saved[key] = tuple(params[key].shape)
            return t

        idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk({}, idx, idx)
        assert sorted(saved.values()) == sorted(saved_parameter_shapes(cfg, partition, 0)), (residual, gain)
    assert gathered_parameter_bytes(cfg, partition, 0, data_parallel=3, dtype="fp32") == 4 * sum(
        -(-s[0] // 3) * 3 * (s[1] if len(s) > 1 else 1) for s in saved_parameter_shapes(cfg, partition, 0))


@pytest.mark.parametrize("residual,key_mode", VARIANTS)
def test_input_peak_of_chunks_of_several_layers_is_derived(residual, key_mode):
    """Under `full` in fp32 a chunk of several layers peaks inside I while an early layer is
    recomputed beside the later layers' W store (`simulator.memory.input_peak_bytes`): held out,
    every size doubled beyond the fitted grid, I's peak (B's peak or the store, and the excess over
    both) within 10% of the most the chunk's microbatch holds."""
    torch.set_num_threads(1)
    rng = random.Random(f"input-peak/{residual}/{key_mode}")
    errors = []
    while len(errors) < 3:
        case = random_case(rng, residual, key_mode, scale=2)
        # tied embeddings were drawn for the case's own split; this one puts the head on another rank
        cfg = dataclasses.replace(case["cfg"], tie_embeddings=False)
        n_chunks = min(cfg.n_layers // 2, 3)
        if n_chunks < 2:
            continue
        partition = make_partition(cfg.n_layers, n_chunks, 1)
        chunk = rng.randrange(1, n_chunks)
        if partition.layers_per_chunk[chunk] < 2:
            continue
        measured = checkpoint_bytes(cfg, partition, chunk, n_sequences=case["n_sequences"], dtype="fp32",
                                    policy="full")
        predicted = activation_bytes(cfg, partition, chunk, tokens=case["n_sequences"] * cfg.seq_len, dtype="fp32",
                                     activation_checkpoint="full")
        most = measured["saved"] + max(measured["transient"], measured["input_kept"])
        peak = {"measured": max(measured["transient"], measured["input_kept"] - measured["saved"])
                + measured["input_transient"],
                "predicted": max(predicted.transient, predicted.stored - predicted.saved) + predicted.input_transient}
        errors.append(abs(peak["predicted"] - peak["measured"]) / most)
    assert max(errors) <= 0.10, errors
