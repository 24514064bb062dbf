"""Training: config validation, LR schedule, clipping, optimiser grouping, the local engine
(determinism, gradient accumulation) and the shared loop's records."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train import RunConfig, StepResult, TrainConfig, clip_grad_norm_, lr_at, run_training
from attnres_pp.train.engines import make_engine
from attnres_pp.train.optim import build_optimizer, decays
from tests.run_helpers import REPO
from tests.whole_model import WholeModel

TINY_MODEL = dict(n_layers=2, d_model=32, n_heads=2, seq_len=32)

VARIANTS = {
    "standard": dict(residual="standard"),
    "full_attnres": dict(residual="attnres", block_size=1),
    "block_attnres": dict(residual="attnres", block_size=2),
    "lr_projected": dict(residual="lr_attnres", block_size=2, key_mode="projected", key_rank=8),
    "lr_sliced": dict(residual="lr_attnres", block_size=2, key_mode="sliced", key_rank=8),
    "msar": dict(residual="msar", block_size=2),
}


# ---- config ----

@pytest.mark.parametrize(
    ("values", "field_name", "hint"),
    [
        (dict(batch_size=10, microbatches=4), "batch_size", "divisible by microbatches=4"),
        (dict(steps=0), "steps", ">= 1"),
        (dict(lr=-1e-3), "lr", "> 0"),
        (dict(lr=float("nan")), "lr", "finite"),
        (dict(microbatches=0), "microbatches", ">= 1"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio", "[0, 1]"),
        (dict(beta2=1.0), "beta2", "[0, 1)"),
        (dict(grad_clip=-1.0), "grad_clip", "0 disables"),
        (dict(eval_every=-1), "eval_every", ">= 0"),
        (dict(steps=True), "steps", "integer"),
        (dict(data=""), "data", "builtin"),
    ],
)
def test_train_config_errors_name_the_field(values, field_name, hint):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field_name}=") as info:
        TrainConfig(**values)
    assert hint in str(info.value)


def test_toml_unknown_keys_and_tables_are_listed(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nstep = 3\n")
    with pytest.raises(ValueError, match=r"unknown train config keys \['step'\]; known keys: .*'steps'"):
        RunConfig.from_toml(path)
    path.write_text("[optim]\nlr = 1.0\n")
    with pytest.raises(ValueError, match=r"unknown config tables \['optim'\]; known tables"):
        RunConfig.from_toml(path)
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        RunConfig.from_toml(path)
    with pytest.raises(ValueError, match="not found"):
        RunConfig.from_toml(tmp_path / "missing.toml")


def test_toml_overrides_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nresidual = "msar"\n[train]\nsteps = 7\n[pipeline]\nstages = 2\nlayer_counts = [3, 1]\n')
    run_cfg = RunConfig.from_toml(path, overrides={"train": {"steps": 9}})
    assert run_cfg.model.residual == "msar" and run_cfg.train.steps == 9 and run_cfg.pipeline.stages == 2
    assert run_cfg.train.lr == TrainConfig().lr
    assert RunConfig.from_dict(json.loads(json.dumps(run_cfg.to_dict()))) == run_cfg


def test_layer_counts_must_sum_to_layers():
    with pytest.raises(ValueError, match="layer_counts.*sum to ModelConfig.n_layers=4"):
        RunConfig(pipeline=PipelineConfig(stages=2, layer_counts=(1, 1)))


def test_tiny_toml_equals_the_defaults():
    assert RunConfig.from_toml(REPO / "configs" / "tiny.toml") == RunConfig()
    example = RunConfig.from_toml(REPO / "configs" / "cluster_example.toml")
    assert example.pipeline.n_chunks > 1


# ---- schedule, clipping, grouping ----

def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=111, warmup_steps=10, lr=1e-2, min_lr_ratio=0.1)
    warm = [lr_at(s, cfg) for s in range(10)]
    assert warm == pytest.approx([1e-2 * (s + 1) / 10 for s in range(10)])
    assert lr_at(10, cfg) == pytest.approx(1e-2)
    decay = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_at(110, cfg) == pytest.approx(1e-3)  # the last step sits on the floor
    assert lr_at(60, cfg) == pytest.approx(1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(0, TrainConfig(steps=1, warmup_steps=0, lr=1e-2)) == pytest.approx(1e-3)


@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (1, 30), (2, 30), (3, 30), (7, 30), (30, 30), (31, 30),
                                                (45, 30), (61, 30), (500, 30), (12, 0)])
def test_every_run_ends_on_the_floor_rate(steps, warmup):
    """The last step's rate is lr * min_lr_ratio for every length, runs shorter than the warmup and
    a 1-step run included; a short run warms up over at most half of itself, then decays."""
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, lr=1e-2, min_lr_ratio=0.1)
    rates = [lr_at(s, cfg) for s in range(steps)]
    assert rates[-1] == pytest.approx(1e-3, rel=1e-12)
    assert max(rates) == pytest.approx(1e-2 if steps > 1 else 1e-3)  # a 1-step run has the floor only
    warm = min(warmup, steps // 2)
    assert rates[:warm] == pytest.approx([1e-2 * (s + 1) / warm for s in range(warm)])
    decay = rates[warm:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_clip_grad_norm_with_and_without_reduce():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.tensor([3.0, 0.0])
    params[1].grad = torch.tensor([4.0])
    assert clip_grad_norm_(params, 10.0) == pytest.approx(5.0)
    assert params[0].grad.tolist() == [3.0, 0.0]  # under the limit: untouched
    norm = clip_grad_norm_(params, 1.0, reduce_sq=lambda sq: sq * 2)  # another rank holds as much
    assert norm == pytest.approx(5.0 * math.sqrt(2))
    scale = 1.0 / (5.0 * math.sqrt(2) + 1e-6)
    assert params[0].grad.tolist() == pytest.approx([3.0 * scale, 0.0])
    assert params[1].grad.tolist() == pytest.approx([4.0 * scale])


def test_decay_grouping_depends_only_on_name_and_shape():
    assert decays("layers.0.mlp.up.weight", (256, 64))
    assert not decays("layers.0.attn.norm.weight", (64,))
    assert not decays("head.read.query", (4, 64))  # stacked pseudo-queries stay undecayed
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3, 3))
    model.v = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.5))
    by_decay = {group["weight_decay"]: group["params"] for group in optimizer.param_groups}
    assert by_decay[0.5][0] is model.w and by_decay[0.0][0] is model.v


# ---- the local engine ----

def _run_cfg(steps=3, model=None, **train):
    train = {"steps": steps, "batch_size": 4, "microbatches": 2, "warmup_steps": 1, "eval_every": 0,
             "eval_batches": 1, **train}
    return RunConfig(model=ModelConfig(**{**TINY_MODEL, **(model or {})}), train=TrainConfig(**train),
                     pipeline=PipelineConfig(launcher="local"))


def _train(cfg: RunConfig, out_dir) -> dict:
    """`run_training` on the engine of a one-process run (`make_engine`), closed afterwards."""
    engine = make_engine(cfg, out_dir)
    try:
        return run_training(cfg, engine, out_dir, progress=False)
    finally:
        engine.close()


def test_single_process_engine_is_deterministic(tmp_path):
    cfg = _run_cfg(steps=3)
    first = _train(cfg, tmp_path / "a")
    second = _train(cfg, tmp_path / "b")
    assert first["losses"] == second["losses"] and first["val_loss"] == second["val_loss"]


@pytest.mark.parametrize("model", [dict(VARIANTS["msar"], tie_embeddings=True),
                                   dict(VARIANTS["block_attnres"], moe_experts=4, moe_top_k=2, moe_d_ff=16)])
def test_the_one_process_run_steps_the_whole_model_bit_for_bit(model):
    """The one-process run is one rank of the pipeline's code holding the whole model: its losses,
    gradient norms, expert loads, evaluation loss and trained parameters equal the whole model's own
    forward, backward and optimiser step (`tests/whole_model.py`) exactly, not within rounding (MSAR's
    tied convolutions and embedding test the norm's summation order, MoE the loads and the bias)."""
    cfg = _run_cfg(steps=3, model=model)
    engine, twin = make_engine(cfg), WholeModel(cfg.model, cfg.train)
    tokens = torch.randint(0, 256, (4, 4, 33), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(3):
            got = engine.train_step(step, tokens[step, :, :-1], tokens[step, :, 1:], 1e-2)
            want = twin.train_step(step, tokens[step, :, :-1], tokens[step, :, 1:], 1e-2)
            assert (got.loss, got.metrics["grad_norm"]) == (want.loss, want.metrics["grad_norm"]), step
            assert got.extras.get("moe_expert_loads") == want.extras.get("moe_expert_loads"), step
        assert engine.eval_loss(tokens[3, :, :-1], tokens[3, :, 1:]) == twin.eval_loss(tokens[3, :, :-1],
                                                                                        tokens[3, :, 1:])
        for name, want_param in twin.model.named_parameters():
            assert torch.equal(engine.model.get_parameter(name), want_param), name
    finally:
        engine.close()


def test_gradient_accumulation_matches_one_microbatch():
    engines = []
    for m in (1, 2):
        cfg = _run_cfg(steps=2, microbatches=m, batch_size=4, model=VARIANTS["msar"])
        engines.append(make_engine(cfg))
    inputs_BT = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    targets_BT = torch.roll(inputs_BT, -1, dims=1)
    losses = [engine.train_step(0, inputs_BT, targets_BT, 1e-3).loss for engine in engines]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for p1, p2 in zip(engines[0].model.parameters(), engines[1].model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_learns_the_builtin_corpus(variant, tmp_path):
    cfg = _run_cfg(steps=30, model=VARIANTS[variant], batch_size=8, lr=1e-2, warmup_steps=3)
    summary = _train(cfg, tmp_path)
    losses = summary["losses"]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (variant, first, last)
    assert summary["val_loss"] < first


# ---- the loop's records ----

class _CountingEngine:
    """An Engine double: the loss is 1 / (step + 1); extras and metrics are echoed."""

    def __init__(self):
        self.seen_lrs, self.evals, self.closed = [], 0, False

    def train_step(self, step, inputs_BT, targets_BT, lr):
        assert inputs_BT is None and targets_BT is None  # engines read the run's batches themselves
        self.seen_lrs.append(lr)
        return StepResult(loss=1.0 / (step + 1), extras={"bubble_fraction": 0.25, "last_step": step},
                          metrics={"bytes": 10 * step})

    def evaluate(self):
        self.evals += 1
        return 0.5

    def param_count(self):
        return 123

    def close(self):
        self.closed = True


def test_loop_writes_metrics_and_summary(tmp_path):
    cfg = _run_cfg(steps=5, eval_every=2, eval_batches=2)
    engine = _CountingEngine()
    summary = run_training(cfg, engine, tmp_path, progress=False)
    assert engine.seen_lrs == pytest.approx([lr_at(s, cfg.train) for s in range(5)])
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("losses", "val_loss", "val_losses", "step_time_s", "tokens_per_s", "params", "config"):
        assert key in on_disk
    assert on_disk["losses"] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert on_disk["val_losses"] == [[1, 0.5], [3, 0.5], [4, 0.5]]  # steps 2 and 4, and the end
    assert engine.evals == 3
    assert on_disk["params"] == 123 and on_disk["bubble_fraction"] == 0.25 and on_disk["last_step"] == 4
    assert RunConfig.from_dict(on_disk["config"]) == cfg
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(5))
    assert lines[3]["bytes"] == 30 and "val_loss" in lines[3] and "val_loss" not in lines[2]
    assert not engine.closed  # the caller owns the engine
