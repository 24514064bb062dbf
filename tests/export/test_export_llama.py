"""`attnres-pp export` of standard-residual runs of the Llama recipe: the folder loads as
transformers' own LlamaForCausalLM (Qwen3ForCausalLM with QK-norm), with no code of ours, and its
logits and greedy tokens are the run's (the tokens from `attnres-pp generate`, our own decoder with
its key/value cache, against transformers' generate with its own)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from attnres_pp.cli import main
from tests.export.export_helpers import (
    assert_same_logits,
    export,
    greedy,
    hf_greedy,
    load_hf,
    ours_from_run,
    tokens,
    train,
)

CASES = {  # name: (train flags, transformers class)
    "llama_grouped_kv": (["--kv-heads", "2", "--residual", "standard"], "LlamaForCausalLM"),
    "qwen3_qk_norm": (["--qk-norm", "--residual", "standard"], "Qwen3ForCausalLM"),
    "llama_tied_mqa": (["--tie-embeddings", "--kv-heads", "1", "--residual", "standard", "--rope-theta", "500"],
                       "LlamaForCausalLM"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    flags, cls = CASES[request.param]
    run = train(root / "run", *flags)
    return run, export(run, root / "hf"), cls


def test_the_folder_is_transformers_own_class_with_our_logits(exported):
    run, folder, cls = exported
    theirs = load_hf(folder)
    assert type(theirs).__name__ == cls and type(theirs).__module__.startswith("transformers.models.")
    assert not (folder / "modeling_attnres.py").exists()  # no code of ours: transformers' own class
    ours = ours_from_run(run)
    assert_same_logits(ours, theirs, tokens(256, 2, 16))
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 16 and config["rms_norm_eps"] == ours.cfg.norm_eps
    assert config["num_key_value_heads"] == ours.cfg.kv_heads and config["head_dim"] == 8
    if ours.cfg.tie_embeddings:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
        assert "lm_head.weight" not in load_file(folder / "model.safetensors")


def test_greedy_generation_matches_attnres_generate(exported, capsys):
    run, folder, _ = exported
    prompt = b"def "
    assert main(["generate", "--resume", str(run), "--prompt", prompt.decode(), "--max-new-tokens", "10",
                 "--temperature", "0", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"]
    theirs = hf_greedy(load_hf(folder), torch.tensor([list(prompt)]), 10)
    assert theirs == [list(prompt) + ours]
    assert greedy(ours_from_run(run), torch.tensor([list(prompt)]), 10) == theirs  # the whole-forward loop too
