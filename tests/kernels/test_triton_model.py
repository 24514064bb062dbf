"""The whole model with the Triton backend against the torch backend (under the interpreter on CPU
without a GPU, compiled on CUDA with one): the loss and every parameter gradient, for each
depth-attention variant (MSAR's is test_triton_msar_streams.py's, through its fused stream kernel).
This covers the packed [values | keys] views the model hands to the ops (strided values, projected
and sliced keys)."""

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attnres_pp.model import ModelConfig, Transformer  # noqa: E402
from tests.run_helpers import assert_same_losses

TINY = dict(vocab_size=32, n_layers=2, d_model=16, n_heads=2, seq_len=6)
VARIANTS = {
    "full": dict(residual="attnres", block_size=1),
    "block": dict(residual="attnres", block_size=3),
    "lr_projected": dict(residual="lr_attnres", key_mode="projected", key_rank=4, block_size=2),
    "lr_sliced": dict(residual="lr_attnres", key_mode="sliced", key_rank=4, block_size=3),
}


def _loss_and_grads(cfg, backend, idx, targets):
    torch.manual_seed(0)
    model = Transformer(cfg, backend=backend).to(idx.device)
    with torch.no_grad():  # non-zero queries and gates, so that reads are not plain means
        generator = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith(("read.query", "gate_weight", "gate_bias")):
                p.copy_(torch.randn(p.shape, generator=generator, device="cpu") * 0.5)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# MSAR's case is test_triton_msar_streams.py::test_the_model_reads_msar_through_the_fused_kernel: the same
# tiny model's loss and every gradient against the torch backend, with its fused launches counted.
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_with_triton_backend_matches_torch_backend(variant, kernel_device):
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant]})
    idx = torch.randint(0, 32, (2, 6), device=kernel_device)
    targets = torch.randint(0, 32, (2, 6), device=kernel_device)
    loss_torch, grads_torch = _loss_and_grads(cfg, "torch", idx, targets)
    loss_triton, grads_triton = _loss_and_grads(cfg, "triton", idx, targets)
    torch.testing.assert_close(loss_triton, loss_torch, atol=1e-5, rtol=1e-5)
    assert grads_triton.keys() == grads_torch.keys()
    for name, grad in grads_torch.items():
        torch.testing.assert_close(grads_triton[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def _train_losses(cfg, backend, batches):
    torch.manual_seed(0)
    model = Transformer(cfg, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for idx, targets in batches:
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("variant", ["block", "lr_projected"])
def test_training_with_triton_backend_gives_the_torch_backend_losses(variant):
    """Three AdamW steps: the queries leave zero after step one, so step two's loss reads with real
    queries and step three's carries the gradients taken through those reads."""
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant]})
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 32, (2, 6), generator=generator), torch.randint(0, 32, (2, 6), generator=generator))
               for _ in range(3)]
    want = _train_losses(cfg, "torch", batches)
    got = _train_losses(cfg, "triton", batches)
    assert want[-1] < want[0]
    assert_same_losses(got, want)
