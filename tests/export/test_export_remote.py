"""Every model outside the Llama recipe (each AttnRes variant, learned positions, GELU) exported with
its code: `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` gives our logits and
our greedy tokens, with transformers' key/value cache (and MSAR's convolution history) and without.
Parameters are randomised first (depth queries, gates, norms, conv taps), so that every read is far
from the plain mean a freshly trained model's almost-zero queries give."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from safetensors.torch import load_file

from attnres_pp.cli import main
from attnres_pp.export.cli import write_folder
from attnres_pp.export.configs import CODE_FILES
from attnres_pp.model import ModelConfig, Transformer
from tests.export.export_helpers import (
    assert_same_logits,
    export,
    greedy,
    hf_greedy,
    load_hf,
    ours_from,
    ours_from_run,
    randomized,
    tokens,
    train,
)

BASE = dict(vocab_size=64, n_layers=3, d_model=32, n_heads=4, seq_len=16)
VARIANTS = {
    "attnres_full": dict(residual="attnres", block_size=1),
    "attnres_block_gqa_qknorm": dict(residual="attnres", block_size=3, n_kv_heads=2, qk_norm=True, key_norm_gain=True),
    "attnres_uneven_blocks_learned_gelu": dict(residual="attnres", blocks=4, positions="learned", mlp="gelu"),
    "lr_projected_tied": dict(residual="lr_attnres", key_mode="projected", key_rank=4, block_size=2,
                              tie_embeddings=True, logit_scale=2.0),
    "lr_sliced": dict(residual="lr_attnres", key_mode="sliced", key_rank=4, block_size=3, n_kv_heads=1),
    "msar": dict(residual="msar", block_size=3, stream_kernels=(2, 3), n_kv_heads=2, key_norm_gain=True),
    "msar_full_default_kernels": dict(residual="msar", block_size=1, qk_norm=True),
    "standard_learned_gelu": dict(residual="standard", positions="learned", mlp="gelu"),
    "standard_rope_gelu_tied": dict(residual="standard", mlp="gelu", tie_embeddings=True),
}


def _input_lengths(theirs) -> list[int]:
    """The length of `input_ids` at each call of `theirs`' forward from now on."""
    seen, forward = [], theirs.forward

    def counted(input_ids, *args, **kwargs):
        seen.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    theirs.forward = counted
    return seen


def assert_cached_logits(ours: Transformer, theirs, idx_BT: torch.Tensor) -> None:
    """A prefill of 5 positions, then passes of 3, 1 and 3 more (past > 0 with several new positions:
    the causal mask across the cache), over transformers' DynamicCache: the logits of every position
    equal ours on the whole sequence (fp32, 1e-5 of the largest)."""
    from transformers import DynamicCache

    cache, edges = DynamicCache(), [0, 5, 8, 9, 12, idx_BT.shape[1]]
    with torch.no_grad():
        passes = [theirs(idx_BT[:, a:b], cache=cache).logits for a, b in zip(edges[:-1], edges[1:], strict=True)]
        got = torch.cat(passes, dim=1)
        want = ours(idx_BT)
    assert cache.get_seq_length() == idx_BT.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def load_sharded(folder, shards: list[str]) -> dict:
    tensors = {}
    for shard in shards:
        tensors.update(load_file(folder / shard))
    return tensors


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_remote_code_gives_our_logits_and_greedy_tokens(variant, tmp_path):
    cfg = ModelConfig(**BASE, **VARIANTS[variant])
    named = randomized(cfg, seed=len(variant))
    files, what = write_folder(tmp_path, cfg, named, max_bytes=10**9)
    assert what.startswith("AttnResForCausalLM") and set(CODE_FILES) <= set(files)
    theirs = load_hf(tmp_path)
    assert type(theirs).__name__ == "AttnResForCausalLM"
    ours = ours_from(cfg, named)
    idx = tokens(cfg.vocab_size, 3, 16, seed=1)
    assert_same_logits(ours, theirs, idx)
    with torch.no_grad():  # transformers' convention: labels are the inputs, shifted inside
        torch.testing.assert_close(theirs(idx, labels=idx).loss, ours(idx[:, :-1], idx[:, 1:]), rtol=1e-5, atol=0)
    prompt = tokens(cfg.vocab_size, 2, 5, seed=2)
    want = greedy(ours, prompt, 11)
    seen = _input_lengths(theirs)
    assert hf_greedy(theirs, prompt, 11) == want  # with the cache (the default): one new token a step
    assert seen == [5] + [1] * 10, seen
    seen.clear()
    assert hf_greedy(theirs, prompt, 11, use_cache=False) == want  # the whole sequence every step
    assert seen == list(range(5, 16)), seen
    assert_cached_logits(ours, theirs, tokens(cfg.vocab_size, 2, 16, seed=3))
    if cfg.residual == "msar":  # beam search reorders the convolution history with the keys and values
        beams = {"num_beams": 3, "num_return_sequences": 3}
        assert hf_greedy(theirs, prompt, 11, **beams) == hf_greedy(theirs, prompt, 11, use_cache=False, **beams)
    if cfg.tie_embeddings:
        assert theirs.head.lm_head.weight.data_ptr() == theirs.embed.tok.weight.data_ptr()


def test_the_copied_code_imports_only_torch_and_transformers(tmp_path):
    write_folder(tmp_path, ModelConfig(**BASE), randomized(ModelConfig(**BASE), 0), max_bytes=10**9)
    for name in CODE_FILES:
        tree = ast.parse((tmp_path / name).read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  and not n.level}
        assert roots <= {"__future__", "torch", "transformers"}, (name, roots)


def test_a_trained_msar_run_exports_in_shards_and_generates_as_attnres_generate(tmp_path, capsys):
    run = train(tmp_path / "run", "--residual", "msar", "--block-size", "3", "--kv-heads", "2")
    capsys.readouterr()
    folder = export(run, tmp_path / "hf", "--max-shard-size", "8KB")
    printed = capsys.readouterr().out
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    tensors = load_sharded(folder, shards)
    assert len(shards) > 3 and set(tensors) == set(index["weight_map"])
    for shard in shards:  # at most 8 KB of tensor data, or one tensor larger than that alone
        held = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(held) == 1 or sum(tensors[n].numel() * 4 for n in held) <= 8000, (shard, held)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert f"{len(shards)} weight shards" in printed and "tokenizer: none written" in printed
    theirs = load_hf(folder)
    assert_same_logits(ours_from_run(run), theirs, tokens(256, 2, 16))
    # 3 + 20 tokens, past the run's seq_len (16); that the window decides tokens: test_export_window.py
    assert main(["generate", "--resume", str(run), "--prompt", "ret", "--max-new-tokens", "20", "--temperature", "0",
                 "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"]
    assert hf_greedy(theirs, torch.tensor([list(b"ret")]), 20) == [list(b"ret") + ours]
