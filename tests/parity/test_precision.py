"""bf16 mixed precision (`--dtype bf16`): autocast compute with fp32 master weights, optimiser state
and gradients; hops, cache entries and deposits in bf16, so a bf16 hop carries half the bytes of an
fp32 one and `attnres-pp simulate comm --dtype` predicts the runtime's bytes exactly; a pipelined
bf16 step computes what the single-process bf16 model computes (every variant), and bf16 training
ends close to fp32's."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.comm.cache import BlockCache
from attnres_pp.data import batch_at, load_corpus
from attnres_pp.train.config import RunConfig, TrainConfig
from attnres_pp.train.engines import make_engine
from attnres_pp.train.optim import lr_at
from tests.pipeline_helpers import model_config
from tests.reference_model import VARIANTS
from tests.run_helpers import summary
from tests.whole_model import WholeModel


# Two steps: the second loss is computed on weights the first bf16 step's fp32 update moved (master
# weights, optimiser state); a third would repeat that path.
def _run_cfg(variant: str, dtype: str, *, steps: int = 2, stages: int = 2, virtual: int = 2, m: int = 4,
             **model) -> RunConfig:
    cfg = model_config(variant, 4, **model)
    return RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": steps, "batch_size": 2 * m, "microbatches": m, "warmup_steps": 1, "dtype": dtype,
                  "device": "cpu", "lr": 3e-3},
        "pipeline": {"stages": stages, "virtual": virtual, "launcher": "inprocess"},
    })


def _batches(n_steps: int, run_cfg: RunConfig):
    g = torch.Generator().manual_seed(5)
    shape = (run_cfg.train.batch_size, run_cfg.model.seq_len)
    return [(torch.randint(0, run_cfg.model.vocab_size, shape, generator=g),) * 2 for _ in range(n_steps)]


def _train(engine, run_cfg, batches):
    losses = []
    for step, (inputs, _) in enumerate(batches):
        targets = torch.roll(inputs, -1, dims=1)
        losses.append(engine.train_step(step, inputs, targets, lr_at(step, run_cfg.train)).loss)
    return losses


@pytest.mark.parametrize("variant,recipe", [(v, {}) for v in sorted(VARIANTS)]
                         + [("block", {"n_heads": 4, "n_kv_heads": 1, "qk_norm": True}),
                            ("msar", {"n_heads": 4, "n_kv_heads": 2, "positions": "learned", "mlp": "gelu"}),
                            ("block", {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 8,
                                       "moe_dense_layers": 1, "moe_balance": "aux_loss"})])
def test_bf16_pipelined_steps_equal_the_bf16_single_process(variant, recipe):
    run_cfg = _run_cfg(variant, "bf16", **recipe)
    batches = _batches(run_cfg.train.steps, run_cfg)
    single = _train(WholeModel(run_cfg.model, run_cfg.train), run_cfg, batches)
    piped_engine = make_engine(run_cfg)
    piped = _train(piped_engine, run_cfg, batches)
    for got, want in zip(piped, single, strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), (piped, single)
    fp32 = _train(WholeModel(run_cfg.model, TrainConfig(**{**run_cfg.train.to_dict(), "dtype": "fp32"})),
                  run_cfg, batches)
    assert single != fp32  # bf16 really computed in bf16
    # Master weights and optimiser state stay fp32, on every rank.
    workers = piped_engine.ranks.workers
    assert all(p.dtype == torch.float32 for w in workers for p in w.params.values())
    states = [t for w in workers for s in w.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert states and all(t.dtype == torch.float32 for t in states if t.dim() > 0)


def test_hops_cache_entries_and_deposits_are_bf16(monkeypatch):
    seen = {"put": set(), "deposit": set()}
    put, deposit = BlockCache.put, BlockCache.deposit
    monkeypatch.setattr(BlockCache, "put", lambda self, mb, s, t: seen["put"].add(t.dtype) or put(self, mb, s, t))
    monkeypatch.setattr(BlockCache, "deposit",
                        lambda self, mb, s, g: seen["deposit"].add(g.dtype) or deposit(self, mb, s, g))
    bytes_by_dtype = {}
    for dtype in ("fp32", "bf16"):
        run_cfg = _run_cfg("block", dtype, stages=2, virtual=2)
        engine = make_engine(run_cfg)
        (inputs, _), = _batches(1, run_cfg)
        result = engine.train_step(0, inputs, inputs, 1e-3)
        bytes_by_dtype[dtype] = result.extras["bytes_sent_per_step"]
        runtimes = [rt for w in engine.ranks.workers for rt in (w.runtime, w.eval_runtime)]
        assert {r.dtype for r in runtimes} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
    assert seen["put"] >= {torch.bfloat16} and seen["deposit"] >= {torch.bfloat16}
    assert bytes_by_dtype["bf16"] * 2 == bytes_by_dtype["fp32"] > 0


@pytest.mark.parametrize("variant,mode", [("block", "cached"), ("lr_projected", "cached"), ("standard", "standard")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_simulate_comm_dtype_agrees_byte_for_byte_with_the_runtime(tmp_path, capsys, variant, mode, dtype):
    cfg = model_config(variant, 4)
    m, micro = 2, 2
    shape = ["--layers", "4", "--d-model", str(cfg.d_model), "--stages", "2", "--virtual", "2"]
    block = [] if variant == "standard" else ["--block-size", str(cfg.block_size)]
    keys = ["--key-mode", cfg.key_mode, "--key-rank", str(cfg.key_rank)] if cfg.residual == "lr_attnres" else []
    assert main(["train", "--launcher", "inprocess", *shape, *block, *keys, "--residual", cfg.residual,
                 "--heads", "2", "--seq-len", str(cfg.seq_len), "--vocab-size", "256",
                 "--batch-size", str(micro * m), "--microbatches", str(m), "--steps", "1", "--eval-every", "0",
                 "--dtype", dtype, "--quiet", "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    run = summary(tmp_path / "run")
    assert run["config"]["train"]["dtype"] == dtype
    assert main(["simulate", "comm", *shape, *(block or ["--block-size", "8"]), *keys, "--residual", cfg.residual,
                 "--tokens", str(micro * cfg.seq_len), "--dtype", dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    predicted = m * report["bytes_per_microbatch_both_directions"][mode]
    assert run["bytes_sent_per_step"] == predicted > 0


def test_bf16_training_ends_within_2_percent_of_fp32():
    corpus = load_corpus("builtin")
    model = model_config("block", 2, d_model=32, seq_len=32, vocab_size=256, n_heads=2)
    final = {}
    for dtype in ("fp32", "bf16"):
        train = TrainConfig(steps=60, batch_size=8, microbatches=1, lr=3e-3, warmup_steps=5, dtype=dtype,
                            device="cpu", eval_every=0)
        engine = WholeModel(model, train)
        losses = []
        for step in range(train.steps):
            inputs, targets = batch_at(corpus.train_tokens_N, step, train.batch_size, model.seq_len, train.seed)
            losses.append(engine.train_step(step, inputs, targets, lr_at(step, train)).loss)
        final[dtype] = sum(losses[-5:]) / 5
        assert losses[-1] < 0.8 * losses[0]  # it trained
    assert abs(final["bf16"] - final["fp32"]) <= 0.02 * final["fp32"], final


def test_dtype_and_kernels_come_from_toml_and_are_validated(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\ndtype = "bf16"\nkernels = "torch"\ndevice = "cpu"\n')
    run_cfg = RunConfig.from_toml(path)
    assert (run_cfg.train.dtype, run_cfg.train.kernels, run_cfg.train.device) == ("bf16", "torch", "cpu")
    with pytest.raises(ValueError, match=r"TrainConfig.dtype='fp16' is invalid: choose one of auto, fp32, bf16"):
        TrainConfig(dtype="fp16")
    with pytest.raises(ValueError, match="TrainConfig.kernels='cuda' is invalid"):
        TrainConfig(kernels="cuda")


@pytest.mark.parametrize("variant", ["block", "msar"])
def test_bf16_data_parallel_steps_equal_the_bf16_single_process(variant):
    """D = 2 replicas of a P = 2, V = 2 pipeline under bf16: rank-local chunks compute in bf16 with
    fp32 master weights, hops in bf16, gradients averaged over the replicas in fp32."""
    run_cfg = _run_cfg(variant, "bf16", m=2)
    run_cfg = RunConfig.from_dict({**run_cfg.to_dict(), "train": {**run_cfg.train.to_dict(), "batch_size": 8},
                                   "pipeline": {**run_cfg.pipeline.to_dict(), "data_parallel": 2}})
    batches = _batches(run_cfg.train.steps, run_cfg)
    single = _train(WholeModel(run_cfg.model, run_cfg.train), run_cfg, batches)
    engine = make_engine(run_cfg)
    piped = _train(engine, run_cfg, batches)
    for got, want in zip(piped, single, strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), (piped, single)
    assert {w.runtime.dtype for w in engine.ranks.workers} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for w in engine.ranks.workers for p in w.params.values())
