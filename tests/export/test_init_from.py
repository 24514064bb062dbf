"""`attnres-pp train --init-from DIR`: an exported Llama/Qwen3 (or Mixtral/Qwen3-MoE) folder starts a
new run with exactly the exported parameters (bitwise, read from the engine's model before step 0,
through the whole command), and every folder that does not fit the run is one `error:` line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

import attnres_pp.train.cli as train_cli
from attnres_pp.cli import main
from attnres_pp.generate.cli import find_checkpoint, load_checkpoint
from tests.export.export_helpers import TINY, export, train

MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-d-ff", "16", "--moe-balance", "aux_loss"]
ROUND_TRIPS = {
    "llama_grouped_kv": ["--residual", "standard", "--kv-heads", "2"],
    "qwen3_tied_mha": ["--residual", "standard", "--qk-norm", "--tie-embeddings"],
    "mixtral": ["--residual", "standard", "--kv-heads", "2", *MOE],
    "qwen3_moe_dense_first": ["--residual", "standard", "--qk-norm", *MOE, "--moe-dense-layers", "1"],
}


@pytest.fixture(scope="module", params=sorted(ROUND_TRIPS))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    run = train(root / "run", *ROUND_TRIPS[request.param])
    sharded = ["--max-shard-size", "4KB"] if request.param.startswith("qwen3") else []  # read through the index
    folder = export(run, root / "hf", *sharded)
    assert (folder / "model.safetensors.index.json").is_file() == bool(sharded)
    kind = json.loads((folder / "config.json").read_text())["model_type"]
    assert kind == request.param.split("_")[0] if "moe" not in request.param else kind == "qwen3_moe"
    return root, run, folder, ROUND_TRIPS[request.param]


def test_init_from_starts_with_the_exported_parameters_bitwise(exported, monkeypatch):
    root, run, folder, flags = exported
    seen = {}

    def first_parameters(run_cfg, engine, out_dir, **kwargs):  # in place of the training loop
        seen.update({n: p.detach().clone() for n, p in engine.model.named_parameters()})
        return {}

    monkeypatch.setattr(train_cli, "run_training", first_parameters)
    # Another seed: its own initialisation would differ everywhere.
    assert main(["train", *TINY, *flags, "--seed", "7", "--init-from", str(folder), "--out", str(root / "b")]) == 0
    _, want = load_checkpoint(find_checkpoint(str(run)))
    assert set(seen) == set(want)
    for name, tensor in want.items():
        assert torch.equal(seen[name], tensor), name


def test_a_run_from_a_folder_trains_and_saves(exported):
    root, _, folder, flags = exported
    out = root / "trained"
    assert main(["train", *TINY, *flags, "--init-from", str(folder), "--out", str(out)]) == 0
    assert (out / "checkpoints" / "step_2" / "meta.json").is_file()


@pytest.mark.parametrize("change, named", [
    (["--d-model", "64"], ["d_model", "head_dim"]),
    (["--kv-heads", "4"], ["kv_heads"]),
    (["--qk-norm"], ["qk_norm"]),
    (["--rope-theta", "500"], ["rope_theta"]),
    (["--residual", "attnres"], ["residual"]),
])
def test_a_run_whose_model_differs_is_refused_naming_the_fields(tmp_path, capsys, change, named):
    root = tmp_path
    run = train(root / "run", "--residual", "standard", "--kv-heads", "2")
    folder = export(run, root / "hf")
    capsys.readouterr()
    flags = ["--residual", "standard", "--kv-heads", "2", *change]
    assert main(["train", *TINY, *flags, "--init-from", str(folder), "--out", str(root / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --init-from") and len(err.splitlines()) == 1
    assert [f for f in ("d_model", "head_dim", "kv_heads", "qk_norm", "rope_theta", "residual") if f" {f} " in err] \
        == named, err
    assert not (root / "b").exists()


@pytest.mark.parametrize("change, named", [
    (["--moe-top-k", "3"], ["moe_top_k"]),
    (["--moe-d-ff", "32"], ["expert_dim"]),
    (["--moe-shared-experts", "1"], ["moe_shared_experts"]),
    (["--moe-router", "sigmoid"], ["moe_router"]),
    (["--moe-dense-layers", "1"], ["moe_dense_layers"]),
])
def test_a_run_whose_experts_differ_is_refused_naming_the_fields(exported_mixtral, capsys, change, named):
    root, folder = exported_mixtral
    capsys.readouterr()
    flags = ["--residual", "standard", "--kv-heads", "2", *MOE, *change]
    assert main(["train", *TINY, *flags, "--init-from", str(folder), "--out", str(root / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --init-from") and len(err.splitlines()) == 1
    fields = ("moe_top_k", "expert_dim", "moe_shared_experts", "moe_router", "moe_dense_layers", "moe_experts")
    assert [f for f in fields if f" {f} " in err] == named, err
    assert not (root / "b").exists()


@pytest.fixture(scope="module")
def exported_mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral_refusals")
    return root, export(train(root / "run", "--residual", "standard", "--kv-heads", "2", *MOE), root / "hf")


def _refused(capsys, argv, out) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def test_folders_that_cannot_start_a_run_are_refused(tmp_path, capsys):
    run = train(tmp_path / "run", "--residual", "standard")
    folder = export(run, tmp_path / "hf")
    remote = export(train(tmp_path / "run_attnres", "--residual", "attnres"), tmp_path / "hf_attnres")
    base = ["train", *TINY, "--residual", "standard", "--out", str(tmp_path / "b")]
    out = tmp_path / "b"
    assert "'attnres_pp' model" in _refused(capsys, [*base, "--init-from", str(remote)], out)
    assert "no config.json" in _refused(capsys, [*base, "--init-from", str(tmp_path / "run")], out)
    assert "one process" in _refused(capsys, [*base, "--init-from", str(folder), "--stages", "2"], out)
    assert "give one of them" in _refused(capsys, ["train", "--resume", str(run), "--init-from", str(folder)],
                                          tmp_path / "never")
    (folder / "model.safetensors").rename(tmp_path / "moved.safetensors")
    assert "neither model.safetensors" in _refused(capsys, [*base, "--init-from", str(folder)], out)
    scaled = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**scaled, "rope_parameters": {"rope_type": "yarn"}}))
    assert "scaled rotary" in _refused(capsys, [*base, "--init-from", str(folder)], out)
    broken = dict(scaled)
    del broken["hidden_size"]
    (folder / "config.json").write_text(json.dumps(broken))
    assert "hidden_size" in _refused(capsys, [*base, "--init-from", str(folder)], out)
