"""Shared pieces of the pipeline parity tests: configs, the single-process reference step, and
the comparison rule."""

from __future__ import annotations

import functools

import torch

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.moe import set_aux_scale
from tests.reference_model import VARIANTS, randomize_depth_params

SEQ = 8
MICRO = 2  # sequences per microbatch


# The depth-attention ops' torch twins in `kernels.dispatch`: a test of the Triton kernels makes them
# raise, so that a step which completes ran the kernels.
TORCH_TWINS = ("phase1_torch", "phase2_torch", "phase1_conv_streams_torch")


def model_config(variant: str, n_layers: int, **overrides) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=32, n_layers=n_layers, d_model=16, n_heads=2, seq_len=SEQ),
                          **VARIANTS[variant], **overrides})


def build_model(cfg: ModelConfig, dtype=torch.float32, backend: str = "torch") -> Transformer:
    """Seeded model whose pseudo-queries and gates are non-zero, so every read is a real softmax."""
    torch.manual_seed(0)
    model = Transformer(cfg, backend=backend).to(dtype)
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    return model


def batch(n_microbatches: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (MICRO * n_microbatches, SEQ)
    return torch.randint(0, 32, shape, generator=g), torch.randint(0, 32, shape, generator=g)


def reference_step(cfg: ModelConfig, inputs, targets, n_microbatches: int, dtype=torch.float32):
    """Loss and every parameter gradient of the single-process model, accumulated over microbatches."""
    model = build_model(cfg, dtype)
    set_aux_scale(model, 1.0 / n_microbatches)  # an MoE aux loss weighs in the step as its microbatch's loss
    total = 0.0
    for i, t in zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True):
        loss = model(i, t)
        (loss / n_microbatches).backward()
        total += float(loss.detach())
    return total / n_microbatches, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@functools.lru_cache(maxsize=64)
def shared_reference_step(cfg: ModelConfig, n_microbatches: int, dtype=torch.float32, seed: int = 2):
    """`reference_step` on `batch(n_microbatches, seed)`, computed once per worker process for cases
    that share the model, the batch and the dtype (several layouts of one config). Read-only: the
    gradients are shared between the tests that ask for them."""
    return reference_step(cfg, *batch(n_microbatches, seed), n_microbatches, dtype=dtype)


def loopback_step(cfg: ModelConfig, schedule_name: str, P: int, V: int, m: int, cache: bool, policy: str = "none", *,
                  retain: bool | None = None, dtype=torch.float32, micro: int = MICRO, seq: int = SEQ, inputs=None,
                  backend: str = "torch", ledger=None):
    """One pipelined step in this process (every rank's runtime over loopback hops): (mean loss,
    parameter gradients, step records). `policy`: activation checkpointing; `retain`: True for the
    split backward's slow twin (I keeps the graph until W), None for the runtime's default (the
    weight store, asserted); `backend`: the
    depth-attention kernels'. The schedule passes `validate` first."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.pipeline.chunk import build_rank_chunks
    from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
    from attnres_pp.schedule.passes import insert_comm
    from attnres_pp.schedule.schedules import build_schedule, schedule_placement
    from attnres_pp.schedule.validate import validate

    model = build_model(cfg, dtype, backend)
    partition = make_partition(cfg.n_layers, P, V, placement=schedule_placement(schedule_name))
    rank_chunks = [build_rank_chunks(model, partition, r, activation_checkpoint=policy) for r in range(P)]
    schedule = insert_comm(build_schedule(schedule_name, P, V, m))
    validate(schedule)
    runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, cache), schedule, (micro, seq),
                                      ledger)
    if retain is None:
        assert not any(r.split_retains_graph for r in runtimes)  # split schedules run through the W store
    for runtime in runtimes:
        runtime.split_retains_graph = bool(retain)
    inputs, targets = inputs if inputs is not None else batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    losses = {mb: loss for r in records for mb, loss in r.losses.items()}
    assert sorted(losses) == list(range(m))
    return sum(losses.values()) / m, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, records


def assert_grads_match(got: dict, want: dict, rtol: float) -> None:
    """Per tensor: max |got - want| <= rtol * max |want| (+ a floor for gradients that cancel to ~0)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 1e-8 if next(iter(want.values())).dtype == torch.float32 else 1e-14
    for name, w in want.items():
        g = got[name]
        assert g is not None, f"{name}: no gradient"
        err = (g - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= rtol * scale + floor, f"{name}: max abs err {err:.3e}, max |grad| {scale:.3e}"


def assert_step_matches(dtype: str, loss: float, grads: dict, want_loss: float, want_grads: dict) -> None:
    """The parity bound of a pipelined step against the single process: float64 to 1e-12 on the loss
    and 1e-10 on every gradient, fp32 to 1e-5 relative on both."""
    if dtype == "float64":
        assert abs(loss - want_loss) <= 1e-12
        assert_grads_match(grads, want_grads, rtol=1e-10)
    else:
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
        assert_grads_match(grads, want_grads, rtol=1e-5)
