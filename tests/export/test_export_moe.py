"""`attnres-pp export` of mixture-of-experts models. A standard-residual model that routes as
transformers' own classes do (softmax router, no shared experts, zero selection bias) loads as
`MixtralForCausalLM` or `Qwen3MoeForCausalLM` with no code of ours (`trust_remote_code=False`);
every other (a nonzero bias, shared experts, a sigmoid router, AttnRes variants) through the exported
code. Each gives our fp32 logits and our greedy tokens.

Parameters are randomised first: router rows scaled up so that the choice of experts is decisive
(far from the near-ties of a fresh router, where one rounding could flip an expert), the selection
bias set where a case has one, norms and depth queries moved away from their init."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from attnres_pp.cli import main
from attnres_pp.export.cli import write_folder
from attnres_pp.export.configs import CODE_FILES
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.moe import route
from tests.export.export_helpers import (
    assert_same_logits,
    export,
    greedy,
    hf_greedy,
    load_hf,
    ours_from,
    ours_from_run,
    tokens,
    train,
)

BASE = dict(vocab_size=64, d_model=32, n_heads=4, seq_len=16, moe_experts=4, moe_top_k=2, moe_d_ff=16)
CASES = {  # name: (ModelConfig fields, a nonzero selection bias, the class transformers loads)
    "mixtral": (dict(n_layers=2, residual="standard", n_kv_heads=2, moe_balance="aux_loss"), False,
                "MixtralForCausalLM"),
    "qwen3_moe_dense_first_tied": (dict(n_layers=3, residual="standard", qk_norm=True, moe_dense_layers=1, d_ff=48,
                                        moe_top_k=3, tie_embeddings=True, moe_balance="none"), False,
                                   "Qwen3MoeForCausalLM"),
    "mixtral_shaped_with_bias": (dict(n_layers=2, residual="standard", n_kv_heads=2), True, "AttnResForCausalLM"),
    "standard_dense_first_no_qk_norm": (dict(n_layers=2, residual="standard", moe_dense_layers=1), False,
                                        "AttnResForCausalLM"),  # Mixtral has no dense layers
    "standard_shared_sigmoid": (dict(n_layers=2, residual="standard", moe_shared_experts=1, moe_router="sigmoid"),
                                False, "AttnResForCausalLM"),
    "block_attnres_shared_bias": (dict(n_layers=3, residual="attnres", block_size=3, moe_shared_experts=2,
                                       moe_dense_layers=1, n_kv_heads=2), True, "AttnResForCausalLM"),
    "lr_projected_sigmoid_shared": (dict(n_layers=3, residual="lr_attnres", key_mode="projected", key_rank=4,
                                         block_size=2, moe_router="sigmoid", moe_shared_experts=1, moe_top_k=1),
                                    True, "AttnResForCausalLM"),
}


def randomized(cfg: ModelConfig, seed: int, bias: bool) -> dict:
    model = Transformer(cfg, seed=seed, backend="torch")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 1.0, generator=gen)  # affinities far apart: a decisive choice
            elif name.endswith("expert_bias") and bias:
                p.normal_(0.0, 0.3, generator=gen)  # as large as the affinities: it moves choices
            elif "read." in name or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    fields, bias, cls = CASES[request.param]
    cfg = ModelConfig(**{**BASE, **fields})
    named = randomized(cfg, seed=len(request.param), bias=bias)
    folder = tmp_path_factory.mktemp(request.param)
    files, what = write_folder(folder, cfg, named, max_bytes=10**9)
    return cfg, named, folder, files, what, cls


def test_the_folder_loads_as_its_class_with_our_logits_and_greedy_tokens(exported):
    cfg, named, folder, files, what, cls = exported
    builtin = cls != "AttnResForCausalLM"
    assert what.startswith(cls) and (set(CODE_FILES) <= set(files)) != builtin
    theirs = load_hf(folder, trust_remote_code=not builtin)
    assert type(theirs).__name__ == cls
    if builtin:
        assert type(theirs).__module__.startswith("transformers.models.")
    ours = ours_from(cfg, named)
    assert_same_logits(ours, theirs, tokens(cfg.vocab_size, 3, 16, seed=1))
    prompt = tokens(cfg.vocab_size, 2, 5, seed=2)
    assert hf_greedy(theirs, prompt, 11) == greedy(ours, prompt, 11)


def test_the_selection_bias_is_read_and_moves_choices(exported):
    """Where a case has a bias, the loaded model gives other logits without it: the test above would
    fail if the remote code ignored the bias."""
    cfg, named, folder, _files, _what, cls = exported
    if not bool(named[f"layers.{cfg.n_layers - 1}.mlp.expert_bias"].any()):
        assert cls != "AttnResForCausalLM" or cfg.moe_router == "sigmoid" or cfg.moe_shared_experts \
            or (cfg.moe_dense_layers and not cfg.qk_norm)  # remote for another reason
        return
    theirs = load_hf(folder)
    idx = tokens(cfg.vocab_size, 3, 16, seed=1)
    with torch.no_grad():
        with_bias = theirs(idx).logits
        for module in theirs.modules():
            if hasattr(module, "expert_bias"):
                module.expert_bias.zero_()
        assert not torch.allclose(theirs(idx).logits, with_bias, rtol=1e-3, atol=1e-3)


def test_builtin_layouts_are_transformers_checkpoint_names(exported):
    cfg, named, folder, _files, _what, cls = exported
    if cls == "AttnResForCausalLM":
        return
    written = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    moe = "block_sparse_moe" if cls == "MixtralForCausalLM" else "mlp"
    gate, down = ("w1", "w2") if cls == "MixtralForCausalLM" else ("gate_proj", "down_proj")
    last = cfg.n_layers - 1
    assert torch.equal(written[f"model.layers.{last}.{moe}.experts.3.{gate}.weight"],
                       named[f"layers.{last}.mlp.experts.gate_up"][3, :cfg.expert_dim])
    assert torch.equal(written[f"model.layers.{last}.{moe}.experts.1.{down}.weight"],
                       named[f"layers.{last}.mlp.experts.down"][1])
    assert not any("bias" in name for name in written)
    assert config["num_experts_per_tok"] == cfg.moe_top_k
    if cls == "Qwen3MoeForCausalLM":
        assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == list(range(cfg.moe_dense_layers))
        assert config["intermediate_size"] == cfg.ff_dim and config["moe_intermediate_size"] == cfg.expert_dim
    else:
        assert config["intermediate_size"] == cfg.expert_dim and config["num_local_experts"] == cfg.moe_experts


def test_ties_go_to_the_lower_index_in_the_remote_code_as_in_ours(tmp_path):
    """Routers with equal rows and small-integer inputs give exactly equal affinities: both routers
    choose the lower index first, and the remote code's choice and gates are ours bitwise."""
    cfg = ModelConfig(**{**BASE, "moe_experts": 6, "moe_top_k": 3}, n_layers=2, residual="attnres", block_size=2)
    named = randomized(cfg, seed=3, bias=False)
    gen = torch.Generator().manual_seed(0)
    router = torch.randint(-2, 3, (6, cfg.d_model), generator=gen).float()
    router[4], router[2], router[5] = router[1], router[0], router[0]  # ties {1, 4} and {0, 2, 5}
    named["layers.1.mlp.router.weight"] = router
    write_folder(tmp_path, cfg, named, max_bytes=10**9)
    theirs = load_hf(tmp_path)
    x_ND = torch.randint(-2, 3, (64, cfg.d_model), generator=gen).float()  # exact dot products
    with torch.no_grad():
        expert_NK, gate_NK = theirs.layers[1].mlp.route(x_ND)
        affinity_NE, want_NK, want_gate_NK = route(cfg, x_ND, router, named["layers.1.mlp.expert_bias"])
    assert torch.equal(expert_NK, want_NK) and torch.equal(gate_NK, want_gate_NK)
    tied_rows = 0
    for chosen, affinity in zip(expert_NK.tolist(), affinity_NE.tolist(), strict=True):
        for a in range(6):
            for b in range(a + 1, 6):
                if affinity[a] != affinity[b] or b not in chosen:
                    continue
                tied_rows += 1  # b chosen, a as good: a is chosen too, before b
                assert a in chosen and chosen.index(a) < chosen.index(b), (chosen, affinity)
    assert tied_rows > 10  # the rule was exercised


def test_trained_runs_export_as_mixtral_or_remote_by_their_bias(tmp_path, capsys):
    """Through the commands: a run balanced by the aux loss keeps a zero bias and is Mixtral; a run
    balanced aux-free has moved its bias and goes through the exported code, as the command says.
    Both generate the tokens of `attnres-pp generate`."""
    moe = ["--residual", "standard", "--moe-experts", "4", "--moe-top-k", "2", "--moe-d-ff", "16"]
    for balance, cls in (("aux_loss", "MixtralForCausalLM"), ("aux_free", "AttnResForCausalLM")):
        run = train(tmp_path / balance, *moe, "--moe-balance", balance)
        capsys.readouterr()
        folder = export(run, tmp_path / f"hf_{balance}")
        printed = capsys.readouterr().out
        assert f"as {cls}" in printed and ("selection bias is nonzero" in printed) == (balance == "aux_free")
        theirs = load_hf(folder, trust_remote_code=cls == "AttnResForCausalLM")
        assert type(theirs).__name__ == cls
        assert_same_logits(ours_from_run(run), theirs, tokens(256, 2, 16))
        assert main(["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--temperature",
                     "0", "--json"]) == 0
        ours = json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"]
        assert hf_greedy(theirs, torch.tensor([list(b"def ")]), 8) == [list(b"def ") + ours]
