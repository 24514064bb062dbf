"""`simulate memory` and `simulate plan` price train's `--blocks N` (blocks placed by their number,
docs/spec.md section 1.2) and `--key-norm-gain` (a gain shaped as each reading site's query): the
block boundaries come from `ModelConfig.block_ends`, the gains are parameters (and, under fsdp,
saved gathered ones); one in-process run of each holds the prediction to its count."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, predict_memory, rank_parameter_shapes
from attnres_pp.simulator.memory_features import checkpoint_features, depth_segments
from attnres_pp.simulator.plan import PlanRequest, plan

CFG = ModelConfig(vocab_size=256, n_layers=8, d_model=64, n_heads=4, seq_len=32, residual="attnres", block_size=2)


@pytest.mark.parametrize("schedule,virtual,ac", [("1f1b", 1, "none"), ("interleaved_1f1b", 2, "full"),
                                                 ("zbv", 2, "selective"), ("interleaved_zb", 2, "none")])
@pytest.mark.parametrize("residual", ["attnres", "lr_attnres", "msar"])
def test_blocks_that_divide_evenly_predict_as_the_block_size(schedule, virtual, ac, residual):
    """8 blocks over 16 sublayers end every 2 sublayers: the same prediction as --block-size 2,
    whatever block_size the config carries beside them (--blocks decides alone)."""
    by_size = dataclasses.replace(CFG, residual=residual)
    by_count = dataclasses.replace(by_size, block_size=5, blocks=8)
    assert by_count.block_ends == by_size.block_ends and by_count.block_size != by_size.block_size
    setup = MemorySetup(schedule=schedule, n_stages=2, n_virtual=virtual, n_microbatches=4, tokens=64, dtype="fp32",
                        activation_checkpoint=ac)
    assert predict_memory(by_count, setup) == predict_memory(by_size, setup)


def test_uneven_blocks_place_the_segments_where_they_end():
    cfg = dataclasses.replace(CFG, blocks=3)  # 16 sublayers: blocks end after 6, 11 and 16
    assert cfg.block_ends == (6, 11, 16)
    partition = make_partition(cfg.n_layers, 2, 1)  # sublayers 0..7 and 8..15
    # Chunk 0: block 1 (sources b_0) for 0..5, block 2 for 6, 7; a merge wherever a partial is open.
    assert depth_segments(cfg, partition, 0) == ([(1, 6), (2, 2)], 6)
    # Chunk 1: block 2 for 8..10, block 3 for 11..15, then the final read over b_0..b_3.
    assert depth_segments(cfg, partition, 1) == ([(2, 3), (3, 5), (4, 1)], 7)
    # Under checkpointing the last layer (sublayers 14, 15) holds every block completed before it.
    features = checkpoint_features(cfg, partition, 1, tokens=32, n_sequences=1, dtype="fp32")
    assert features["out_held_blocks_tw"] == 3 * 32 * cfg.source_width
    assert features["last_in_partial_tw"] == 32 * cfg.source_width  # 14 is inside block 3
    # The same split by --block-size 6 (ends 6, 12, 16) reads differently in chunk 1.
    assert depth_segments(dataclasses.replace(CFG, block_size=6), partition, 1)[0] == [(2, 4), (3, 4), (4, 1)]


@pytest.mark.parametrize("residual", ["attnres", "lr_attnres", "msar"])
def test_key_norm_gain_adds_one_query_shape_per_reading_site(residual):
    cfg = dataclasses.replace(CFG, residual=residual)
    partition = make_partition(cfg.n_layers, 2, 1)
    query = (cfg.n_streams, cfg.d_model) if residual == "msar" else (cfg.query_dim,)
    for pp_rank, sites in ((0, 8), (1, 9)):  # two per layer, and the final read on the last chunk
        plain = rank_parameter_shapes(cfg, partition, pp_rank)
        gained = rank_parameter_shapes(dataclasses.replace(cfg, key_norm_gain=True), partition, pp_rank)
        assert sorted(gained) == sorted(plain + [query] * sites)


# A train run and its simulate memory twin: blocks by number, key-norm gain, projected LR keys, zbv.
MODEL = ["--layers", "8", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--vocab-size", "256",
          "--residual", "lr_attnres", "--blocks", "5", "--key-norm-gain"]
LAYOUT = ["--schedule", "zbv", "--stages", "2", "--virtual", "2", "--microbatches", "4", "--dtype", "fp32"]


def test_blocks_and_key_norm_gain_predicted_against_a_run(tmp_path, capsys):
    assert main(["train", "--steps", "2", "--launcher", "inprocess", "--device", "cpu", "--threads", "1", "--quiet",
                 "--batch-size", "4", "--cache", "on", "--out", str(tmp_path), *MODEL, *LAYOUT]) == 0
    counted = json.loads((tmp_path / "summary.json").read_text())["memory_per_rank"]
    capsys.readouterr()
    assert main(["simulate", "memory", "--json", "--tokens", "32", *MODEL, *LAYOUT]) == 0
    predicted = json.loads(capsys.readouterr().out)["memory_per_rank"]
    assert len(counted) == len(predicted) == 2
    for got, want in zip(counted, predicted, strict=True):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "cache_peak_bytes"):
            assert got[key] == want[key], key
        assert abs(want["activation_peak_bytes"] - got["activation_peak_bytes"]) <= 0.05 * got["activation_peak_bytes"]


def test_plan_takes_blocks_and_key_norm_gain_and_prints_them_in_the_command(capsys):
    cfg = dataclasses.replace(CFG, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, vocab_size=32000, blocks=3,
                              key_norm_gain=True)
    rows = plan(PlanRequest(model=cfg, global_batch=16, gpus=4, gpu_memory_gib=12.0, top=3))
    assert rows and {row["config"]["blocks"] for row in rows} == {3}
    assert len({row["config"]["block_size"] for row in rows}) == 1  # fixed: no block sizes searched
    assert all("--blocks 3" in row["command"] and "--key-norm-gain" in row["command"]
               and "--block-size" not in row["command"] for row in rows)
    argv = ["simulate", "plan", "--layers", "8", "--d-model", "1024", "--heads", "8", "--seq-len", "2048",
            "--global-batch", "16", "--gpus", "4", "--gpu-memory-gib", "12", "--top", "3", "--blocks", "3",
            "--key-norm-gain", "--vocab-size", "32000", "--tensor-parallel", "1", "--json"]
    assert main(argv) == 0
    assert [r["config"] for r in json.loads(capsys.readouterr().out)["rows"]] == [r["config"] for r in rows]
