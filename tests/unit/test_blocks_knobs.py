"""The papers' knobs (docs/spec.md section 1.2): `blocks = N` places block boundaries at ceil(L i / N), the
model, the payload planner and the simulator all follow those boundaries, and `key_norm_gain` adds a
learned gain to the key norm that starts as the identity. Pipelined steps with N blocks against the single
process are cases of tests/parity/test_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model, plan_payloads
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.config import block_ends_of
from attnres_pp.simulator.comm import comm_report
from attnres_pp.simulator.units import chunk_work
from tests.pipeline_helpers import batch, build_model, model_config
from tests.run_helpers import summary


def test_block_ends_follow_the_ceiling_rule():
    assert block_ends_of(8, blocks=3) == (3, 6, 8)  # sizes 3, 3, 2: the remainder is spread
    assert block_ends_of(12, blocks=5) == (3, 5, 8, 10, 12)
    assert block_ends_of(10, block_size=4) == (4, 8, 10)  # block_size: the last block short
    for L in (4, 8, 12, 24):
        for N in range(1, L + 1):
            ends = block_ends_of(L, blocks=N)
            assert ends == tuple(math.ceil(L * i / N) for i in range(1, N + 1))
            assert len(ends) == N and ends[-1] == L and all(b > a for a, b in zip((0,) + ends, ends, strict=False))
            if L % N == 0:
                assert ends == block_ends_of(L, block_size=L // N)


@pytest.mark.parametrize("bad", [-1, 9, 2.0, True])
def test_blocks_out_of_range_is_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match="blocks"):
        ModelConfig(n_layers=4, blocks=bad)


@pytest.mark.parametrize("variant", ["block", "lr_projected", "lr_sliced", "msar"])
def test_blocks_equal_to_block_size_gives_identical_losses_and_grads(variant):
    """N = L / S places the same boundaries as S: the same model, bit for bit."""
    by_size = model_config(variant, 4, block_size=2)
    by_count = model_config(variant, 4, blocks=4)
    assert by_size.block_ends == by_count.block_ends == (2, 4, 6, 8)
    inputs, targets = batch(1)
    losses, grads = [], []
    for cfg in (by_size, by_count):
        model = build_model(cfg)
        loss = model(inputs, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_planner_blocks_follow_the_boundaries():
    """Naive hops carry b_0, every block completed by then and the open partial, with the boundaries
    of N = 3 over 8 sublayers (3, 6, 8), 4 chunks of 2 sublayers each."""
    partition = make_partition(4, 4, 1)
    plan = plan_payloads(n_sublayers=8, block_ends=block_ends_of(8, blocks=3), partition=partition, mode="naive")
    assert [[str(s) for s in hop] for hop in plan.hops] == [["b0", "p1"], ["b0", "b1", "p2"], ["b0", "b1", "b2"]]
    with pytest.raises(ValueError, match="exactly one"):
        plan_payloads(n_sublayers=8, block_size=2, block_ends=(2, 4, 6, 8), partition=partition, mode="naive")


def test_simulator_comm_and_units_use_the_boundaries():
    cfg = ModelConfig(n_layers=6, d_model=16, n_heads=2, blocks=5)
    partition = make_partition(6, 2, 2)
    report = comm_report(n_layers=6, block_size=1, blocks=5, n_stages=2, n_virtual=2, tokens=4, d_model=16,
                         source_width=16)
    assert report.fwd_hop_tensors["cached"] == plan_for_model(cfg, partition, True).fwd_hop_tensors
    assert report.fwd_hop_tensors["naive"] == plan_for_model(cfg, partition, False).fwd_hop_tensors
    assert report.to_dict()["blocks"] == 5
    # Chunk 1 holds sublayers 4..7 (over a 6-layer model split 2,2,1,1): block 2 ends at 5, block 3 at 8.
    work = chunk_work(ModelConfig(n_layers=6, blocks=5), make_partition(6, 2, 2), 1)
    # Sublayer 4 reads b0, b1 and block 2's partial; 5 opens block 3; 6 and 7 read its partial.
    assert work.segments == ((2, 1), (3, 3)) and work.n_merges == 3


def test_train_flags_fill_blocks_and_key_norm_gain():
    from attnres_pp.cli import build_parser
    from attnres_pp.train.cli import build_run_config

    args = build_parser().parse_args(["train", "--layers", "3", "--blocks", "4", "--key-norm-gain"])
    model = build_run_config(args).model
    assert model.blocks == 4 and model.key_norm_gain and model.block_ends == (2, 3, 5, 6)


def test_block_size_and_blocks_together_is_one_error_line(tmp_path, capsys):
    from attnres_pp.cli import main

    code = main(["train", "--launcher", "local", "--block-size", "2", "--blocks", "3", "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == ("error: give one of --block-size S (sublayers per block) and --blocks N "
                                       "(number of blocks)\n")


def test_key_norm_gain_starts_as_the_identity_and_folds_into_the_query():
    inputs, targets = batch(1)
    plain_cfg = model_config("block", 2)
    gain_cfg = model_config("block", 2, key_norm_gain=True)
    plain, gained = build_model(plain_cfg), build_model(gain_cfg)
    extra = sorted(set(dict(gained.named_parameters())) - set(dict(plain.named_parameters())))
    assert all(name.endswith("read.key_gain") for name in extra) and len(extra) == plain_cfg.n_sublayers + 1
    # Off (the default) is the model without gains; on, every gain starts at 1, the same function (init rule: ones).
    fresh = Transformer(gain_cfg, backend="torch")
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in fresh.named_parameters() if n.endswith("key_gain"))
    gained.load_state_dict({**plain.state_dict(), **{n: torch.ones_like(p) for n, p in gained.named_parameters()
                                                      if n.endswith("key_gain")}})
    assert torch.equal(plain(inputs, targets), gained(inputs, targets))
    # A gain g scores like the query w * g, and it learns (a gradient reaches it).
    with torch.no_grad():
        for name, p in gained.named_parameters():
            if name.endswith("key_gain"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
        folded = {n: p for n, p in gained.state_dict().items() if not n.endswith("key_gain")}
        for name in list(folded):
            if name.endswith("read.query"):
                folded[name] = folded[name] * gained.state_dict()[name.replace("query", "key_gain")]
    plain.load_state_dict(folded)
    loss = gained(inputs, targets)
    torch.testing.assert_close(loss, plain(inputs, targets), rtol=1e-6, atol=1e-6)
    loss.backward()
    assert any(float(p.grad.abs().sum()) > 0 for n, p in gained.named_parameters() if n.endswith("key_gain"))


def test_training_with_blocks_n_equals_training_with_block_size(tmp_path):
    """`--blocks 4` over 4 layers (8 sublayers) trains exactly as `--block-size 2`: identical losses."""
    from attnres_pp.cli import main

    common = ["train", "--launcher", "local", "--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16",
              "--batch-size", "4", "--steps", "3", "--quiet", "--residual", "lr_attnres", "--key-mode", "sliced",
              "--key-rank", "4"]
    assert main([*common, "--block-size", "2", "--out", str(tmp_path / "size")]) == 0
    assert main([*common, "--blocks", "4", "--out", str(tmp_path / "count")]) == 0
    losses = [summary(tmp_path / name)["losses"] for name in ("size", "count")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
