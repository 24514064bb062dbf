"""`attnres-pp simulate project`: the per-mode table against figures computed by hand, and its one-line
errors."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.project import Cluster, project

# d = 64, d_ff = 256, 128 tokens per microbatch (one sequence of 128), vocabulary 100, bf16.
D, FF, T, VOCAB, BF16 = 64, 256, 128, 100, 2


def _cfg(layers: int, block_size: int) -> ModelConfig:
    return ModelConfig(n_layers=layers, d_model=D, n_heads=1, d_ff=FF, seq_len=T, vocab_size=VOCAB,
                       block_size=block_size)


def test_standard_row_by_hand():
    cluster = Cluster(schedule="gpipe", n_stages=2, n_microbatches=1, data_parallel=4, tflops=1.0, hbm_tbs=1.0,
                      link_gbs=1.0, link_latency_us=10.0)
    row = project(_cfg(2, 2), tokens=T, dtype_bytes=BF16, cluster=cluster)[0]
    assert row["mode"] == "standard"
    # the default recipe: one head, rotary q and k (3 FLOPs a number), SwiGLU's three matrices
    attention = 2 * T * (3 * D * D + D * D) + 2 * T * T * D + 3 * T * 2 * D
    mlp = 2 * T * (2 * D * FF + FF * D)
    tensor = T * D * BF16
    adds = 2 * 3 * tensor / 1e12  # two residual adds per layer: read 2, write 1 tensor each
    forward_0 = (attention + mlp) / 1e12 + adds
    forward_1 = forward_0 + 2 * T * D * VOCAB / 1e12  # + the LM head
    link = tensor / 1e9 + 10e-6
    pipeline = 3 * (forward_0 + forward_1) + 2 * link  # gpipe, m = 1: F0, hop, F1, B1, hop, B0; B = 2 F
    assert row["pipeline_s"] == pytest.approx(pipeline)
    per_layer = 2 * D + 3 * D * D + D * D + 2 * D * FF + FF * D
    rank0 = per_layer + VOCAB * D  # + the token embedding (rotary positions: no table)
    rank1 = per_layer + D + VOCAB * D  # + the output norm and the LM head: the fuller rank
    allreduce = 2 * 3 / 4 * max(rank0, rank1) * BF16 / 1e9 + 2 * 3 * 10e-6  # ring over D = 4
    assert row["allreduce_s"] == pytest.approx(allreduce)
    assert row["step_s"] == pytest.approx(pipeline + allreduce)
    assert row["bubble_fraction"] == pytest.approx(1 - 3 * (forward_0 + forward_1) / (2 * pipeline))
    assert row["bytes_per_step_busiest_link"] == tensor and row["bytes_per_step_all_links"] == 2 * tensor
    assert row["peak_cache_bytes_per_rank"] == 0 and row["overhead_vs_standard"] == 0


def test_cache_memory_bytes_and_overheads():
    # 4 layers, blocks of 1 layer, P = 2, V = 2 (chunk c = layer c), gpipe with m = 2: rank 0 keeps
    # b_0, b_1 of chunk 0 and rank 1 b_0, b_1, b_2 of chunk 1 for their later chunks, per microbatch.
    cluster = Cluster(schedule="gpipe", n_stages=2, n_virtual=2, n_microbatches=2, tflops=1.0, link_gbs=1.0)
    rows = {r["mode"]: r for r in project(_cfg(4, 2), tokens=T, dtype_bytes=BF16, cluster=cluster)}
    tensor = T * D * BF16
    assert rows["cached"]["peak_cache_bytes_per_rank"] == 2 * 3 * tensor
    assert rows["naive"]["peak_cache_bytes_per_rank"] == 0
    # Forward tensors per hop (docs/spec.md section 4): naive 2, 3, 4; cached 2, 1, 1 (only what the receiver lacks);
    # Full AttnRes naive 3, 5, 7. Both directions, m = 2.
    assert rows["naive"]["bytes_per_step_all_links"] == 2 * 9 * tensor * 2
    assert rows["cached"]["bytes_per_step_all_links"] == 2 * 4 * tensor * 2
    assert rows["full_naive"]["bytes_per_step_all_links"] == 2 * 15 * tensor * 2
    # Rank 0 -> 1 carries hops 0 and 2 and the gradients of hop 1: cached 2 + 1 + 1 tensors per microbatch.
    assert rows["cached"]["bytes_per_step_busiest_link"] == (2 + 1 + 1) * tensor * 2
    assert rows["naive"]["bytes_per_step_busiest_link"] == (2 + 4 + 3) * tensor * 2
    assert rows["full_naive"]["overhead_vs_standard"] > rows["naive"]["overhead_vs_standard"] > 0
    assert rows["cached"]["step_s"] <= rows["naive"]["step_s"]


def test_cli_table_and_json(capsys):
    argv = ["simulate", "project", "--layers", "8", "--d-model", "256", "--block-size", "4", "--tokens", "512",
            "--stages", "2", "--virtual", "2", "--microbatches", "4", "--data-parallel", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Block cached" in out and "Full AttnRes naive" in out and "vs standard" in out
    assert main(argv + ["--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [m["mode"] for m in payload["modes"]] == ["standard", "full_naive", "naive", "cached"]
    assert payload["cluster"]["data_parallel"] == 2


@pytest.mark.parametrize(("extra", "needle"), [
    (["--link-gbs", "0"], "link_gbs=0.0"),
    (["--link-gbs", "-3"], "link_gbs=-3.0"),
    (["--link-gbs", "nan"], "--link-gbs 'nan'"),
    (["--tflops", "fast"], "--tflops 'fast'"),
    (["--latency-us", "-1"], "link_latency_us=-1.0"),
    (["--data-parallel", "0"], "data_parallel=0"),
    (["--hbm-tbs", "inf"], "--hbm-tbs 'inf'"),
    (["--tokens", "0"], "--tokens 0"),
    (["--microbatches", "1"], "needs m >= P=2 microbatches"),
])
def test_cli_bad_values_exit_2_with_one_line(capsys, extra, needle):
    argv = ["simulate", "project", "--layers", "8", "--d-model", "256", "--block-size", "4", "--tokens", "512",
            "--stages", "2", "--virtual", "2", "--microbatches", "4"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert "error: " in err and needle in err and len(err.strip().splitlines()) == 1, err


def test_cli_names_a_missing_flag(capsys):
    assert main(["simulate", "project", "--layers", "8"]) == 2
    assert "--d-model is required" in capsys.readouterr().err
