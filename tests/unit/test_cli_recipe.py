"""The layer recipe from the command line: new runs train rope + SwiGLU unless told otherwise, a
checkpoint written before the recipe existed resumes and generates with the recipe it was trained
with (learned positions, GELU), and a bad recipe is one `error:` line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from attnres_pp.cli import main
from tests.run_helpers import assert_same_losses, losses, summary

TINY = ["--layers", "2", "--d-model", "16", "--heads", "4", "--seq-len", "8", "--batch-size", "2",
        "--microbatches", "1", "--launcher", "local", "--quiet"]


def test_a_new_run_trains_the_default_recipe_and_the_flags_set_each_part(tmp_path):
    out = tmp_path / "default"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    model = summary(out)["config"]["model"]
    assert (model["positions"], model["mlp"], model["n_kv_heads"], model["qk_norm"]) == ("rope", "swiglu", 0, False)
    out = tmp_path / "set"
    assert main(["train", *TINY, "--steps", "1", "--positions", "learned", "--mlp", "gelu", "--kv-heads", "2",
                 "--qk-norm", "--tie-embeddings", "--rope-theta", "500", "--out", str(out)]) == 0
    model = summary(out)["config"]["model"]
    assert (model["positions"], model["mlp"], model["n_kv_heads"], model["qk_norm"], model["tie_embeddings"],
            model["rope_theta"]) == ("learned", "gelu", 2, True, True, 500.0)


def test_a_checkpoint_from_before_the_recipe_resumes_and_generates_as_it_was_trained(tmp_path, capsys):
    """A run trained with learned positions and GELU whose meta.json lacks the recipe's keys (as every
    checkpoint written before them): `--resume` from its step 2 ends as the uninterrupted run did
    (the default recipe would be another model, refused), and `generate` reads it."""
    run, again = tmp_path / "run", tmp_path / "again"
    assert main(["train", *TINY, "--positions", "learned", "--mlp", "gelu", "--steps", "4", "--checkpoint-every", "2",
                 "--out", str(run)]) == 0
    shutil.copytree(run / "checkpoints" / "step_2", again / "checkpoints" / "step_2")
    (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:2]))
    meta_path = again / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("positions", "rope_theta", "mlp", "n_kv_heads", "qk_norm", "tie_embeddings"):
        del meta["config"]["model"][key]
    meta_path.write_text(json.dumps(meta))
    assert main(["train", "--resume", str(again), "--quiet"]) == 0
    assert_same_losses(losses(again), losses(run))
    assert summary(again)["config"]["model"]["positions"] == "learned"
    capsys.readouterr()
    assert main(["generate", "--resume", str(again), "--prompt", "ab", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize(("argv", "needle"), [
    (["--kv-heads", "3"], "ModelConfig.n_kv_heads=3 is invalid: must divide the 4 query heads"),
    (["--kv-heads", "two"], "--kv-heads 'two' is invalid: expected an integer"),
    (["--rope-theta", "0"], "ModelConfig.rope_theta=0.0 is invalid: must be a finite number > 0"),
    (["--rope-theta", "-1"], "ModelConfig.rope_theta=-1.0 is invalid"),
    (["--positions", "alibi"], "ModelConfig.positions='alibi' is invalid: choose one of rope, learned"),
    (["--mlp", "relu"], "ModelConfig.mlp='relu' is invalid: choose one of swiglu, gelu"),
    (["--heads", "16"], "rotary positions need an even head dimension"),
    (["--tie-embeddings", "--stages", "2", "--data-parallel", "2", "--fault-tolerance", "replicas"],
     "--tie-embeddings with --fault-tolerance replicas needs the embedding and the LM head on one pipeline rank"),
    (["--kv-heads", "1", "--tensor-parallel", "2", "--device", "cpu"],
     "--tensor-parallel 2 does not divide the 1 key/value heads (--kv-heads)"),
])
def test_a_bad_recipe_is_one_error_line_and_nothing_written(tmp_path, capsys, argv, needle):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
