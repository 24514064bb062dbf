"""`--compile` (Transformer(compile=True)): 3 AdamW steps of every variant equal eager's to 1e-5
(losses and final parameters, float64), and a pipelined run with --compile is refused with one error line.

In CI every variant runs under the "aot_eager" backend (the same graph capture and AOTAutograd
forward/backward split as inductor, without generating C++: seconds instead of a minute per variant on
CPU) and MSAR, the variant with the most ops per read, also under inductor."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.train.config import RunConfig
from tests.reference_model import VARIANTS

TINY = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=12)
STEPS = 3


def _train(model: Transformer, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 13), generator=generator)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


# Inductor compiles C++ with the system compiler, in child processes.
# The last recipe: grouped kv heads (SDPA's enable_gqa inside the graph), QK-norm, tied embeddings.
GROUPED = {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True, "tie_embeddings": True}


@pytest.mark.parametrize("variant,backend,recipe", [(v, "aot_eager", {}) for v in sorted(VARIANTS)]
                         + [("msar", "aot_eager", GROUPED), ("lr_projected", "aot_eager", GROUPED),
                            pytest.param("msar", "inductor", {}, marks=pytest.mark.subprocess)])
def test_compiled_training_equals_eager_over_3_steps(variant, backend, recipe):
    torch._dynamo.reset()
    from torch._inductor import config as inductor_config

    # Inductor first probes each vector ISA the CPU reports by building a C++ file of ATen's vector
    # headers with its flags (~2.5 CPU-s of g++ each, three of them here), to fall back to a narrower
    # ISA where one does not build. vec_isa_ok trusts the CPU's report instead: the same ISA is picked
    # wherever the probes pass, and the kernels still build against those headers with its flags, so
    # a machine where they would not fails here instead of falling back.
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        _check_compiled_training_equals_eager(variant, backend, recipe)


def _check_compiled_training_equals_eager(variant, backend, recipe):
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant], **recipe})
    # float64: what is compared is the compiled graphs' math, not fp32 rounding amplified by AdamW.
    eager = Transformer(cfg, backend="torch", seed=3).double()
    compiled = Transformer(cfg, backend="torch", seed=3, compile=True, compile_backend=backend).double()
    # Three steps: the first call compiles and runs the graphs on the initial weights, the second runs
    # them again on weights the compiled backward's gradients moved (guards re-checked) and the third
    # applies AdamW's second update, whose moments carry those gradients; a further step repeats that.
    want, got = _train(eager, STEPS), _train(compiled, STEPS)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    assert compiled.layers[0].attn._compiled_call_impl is not None  # compiled, not silently eager


def test_compile_is_a_train_table_key():
    one_process = {"stages": 1, "virtual": 1, "launcher": "local"}
    assert RunConfig.from_dict({"train": {"compile": True}, "pipeline": one_process}).train.compile is True
    with pytest.raises(ValueError, match=r"\[train\] compile"):
        RunConfig.from_dict({"train": {"compile": "yes"}})


@pytest.mark.parametrize("flags", [["--stages", "2"], ["--stages", "2", "--schedule", "zb_h1"]])
def test_compile_with_a_pipeline_is_refused_in_one_line(flags, tmp_path, capsys):
    assert main(["train", "--compile", "--steps", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: TrainConfig.compile=True is invalid for a pipelined run")
    assert "split-backward" in err[0]


def test_the_one_process_run_compiles_what_the_model_compiles():
    """`--compile` on the one-process run (one rank holding the whole model) compiles the same modules
    as `Transformer(compile=True)`: every sublayer, its depth read and the head's read."""
    from attnres_pp.train.engines import make_engine

    run_cfg = RunConfig.from_dict({"model": TINY, "pipeline": {"launcher": "local"},
                                   "train": {"compile": True, "device": "cpu", "batch_size": 2, "microbatches": 1}})
    engine = make_engine(run_cfg)
    try:
        model = engine.model
        want = Transformer(run_cfg.model, backend="torch", compile=True)
        compiled = sorted(name for name, module in want.named_modules() if module._compiled_call_impl is not None)
        assert compiled and compiled == sorted(name for name, module in model.named_modules()
                                               if module._compiled_call_impl is not None)
    finally:
        engine.close()
