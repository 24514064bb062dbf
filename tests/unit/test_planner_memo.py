"""The planner's shortcuts give what their definitions give: a rank's chunks in closed form against
the scan over every chunk's rank, and a memoised layer pass as a fresh dict each time (a caller
that edits its copy leaves the next caller's alone)."""

from __future__ import annotations

import pytest

from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory_features import _layer_pass


@pytest.mark.parametrize("placement", ["loop", "vshape"])
def test_chunks_of_is_the_scan_over_every_chunks_rank(placement):
    for n_stages in range(1, 6):
        for n_virtual in ((2,) if placement == "vshape" else (1, 2, 3)):
            partition = make_partition(4 * n_stages * n_virtual, n_stages, n_virtual, placement=placement)
            for pp_rank in range(-1, n_stages + 1):
                scan = [c for c in range(partition.n_chunks) if partition.rank_of(c) == pp_rank]
                assert partition.chunks_of(pp_rank) == scan, (n_stages, n_virtual, pp_rank)


def test_a_memoised_layer_pass_is_a_fresh_dict():
    cfg = ModelConfig(vocab_size=32, n_layers=4, d_model=16, n_heads=2, seq_len=8, residual="attnres", block_size=3)
    first = _layer_pass(cfg, range(2, 4), tokens=16, n_sequences=2, dtype="bf16")
    want = dict(first)
    first["layer_td"] = -1
    assert _layer_pass(cfg, range(2, 4), tokens=16, n_sequences=2, dtype="bf16") == want
    assert want["layer_td"] == 16 * 16 and want["in_partial_tw"] > 0  # a partial open before sublayer 2
