"""What the export tests share: tiny runs trained in-process, loading an exported folder with
transformers' own classes, our model's logits and greedy tokens, and the parity rule."""

from __future__ import annotations

from pathlib import Path

import torch

from attnres_pp.cli import main
from attnres_pp.generate.cli import find_checkpoint, load_checkpoint
from attnres_pp.model import ModelConfig, Transformer

TINY = ["--launcher", "local", "--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
        "--batch-size", "2", "--microbatches", "1", "--steps", "2", "--lr", "0.05", "--eval-every", "0", "--quiet"]


def train(out: Path, *flags: str) -> Path:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return out


def export(run: Path, out: Path, *flags: str) -> Path:
    assert main(["export", "--resume", str(run), "--out", str(out), *flags]) == 0
    return out


def randomized(cfg: ModelConfig, seed: int) -> dict:
    """Our parameters with every depth-attention and norm parameter moved well away from its init
    (a fresh model's almost-zero queries read the plain mean of the sources)."""
    model = Transformer(cfg, seed=seed, backend="torch")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "read." in name or "norm" in name or name.startswith("stream_convs"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_hf(folder: Path, *, trust_remote_code: bool = True):
    """The folder's model as transformers loads it, checked to have loaded every tensor it holds and
    to have left none of its own parameters unloaded."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                       dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def ours_from_run(run: Path) -> Transformer:
    cfg, named = load_checkpoint(find_checkpoint(str(run)))
    return ours_from(cfg, named)


def ours_from(cfg: ModelConfig, named: dict) -> Transformer:
    model = Transformer(cfg, backend="torch")
    model.load_state_dict(named, strict=not cfg.tie_embeddings)
    return model.eval()


def assert_same_logits(ours: Transformer, theirs, idx_BT: torch.Tensor) -> None:
    """fp32 logits equal to 1e-5 of the largest (relative to the logits' scale)."""
    with torch.no_grad():
        want, got = ours(idx_BT), theirs(idx_BT).logits
    scale = float(want.abs().max())
    assert scale > 0.1  # logits that are not all ~0: the comparison can fail
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def greedy(ours: Transformer, prompt_BT: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Our greedy continuation, each token from a whole-sequence forward (within seq_len)."""
    seq = prompt_BT
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, ours(seq)[:, -1:].argmax(-1)], dim=1)
    return seq.tolist()


def hf_greedy(theirs, prompt_BT: torch.Tensor, new_tokens: int, **options) -> list[list[int]]:
    with torch.no_grad():
        out = theirs.generate(prompt_BT, attention_mask=torch.ones_like(prompt_BT), max_new_tokens=new_tokens,
                              do_sample=False, **options)
    return out.tolist()


def tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
