"""A damaged or planted meta.json is one `error:` line, exit 2, for `train --resume` and `generate
--resume`, naming the file and the field: not a TypeError traceback from the reader that used it."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2", "--microbatches",
        "1", "--launcher", "local", "--quiet"]
DAMAGE = [
    ("not-an-object", [], "does not hold a JSON object"),
    ("config-a-number", {"config": 5}, "'config' must be an object"),
    ("losses-null", {"losses": None}, "'losses' must be a list of numbers, not None"),
    ("steps-done-negative", {"steps_done": -1}, "'steps_done' must be a non-negative integer"),
    ("val-losses-flat", {"val_losses": [1.5]}, "'val_losses' must be a list of [step, loss] pairs"),
    ("no-config", {"config": None, "drop": "config"}, "has no 'config'"),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("meta") / "run"
    assert main(["train", *TINY, "--steps", "1", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize(("case", "change", "needle"), DAMAGE, ids=[c[0] for c in DAMAGE])
@pytest.mark.parametrize("command", ["train", "generate"])
def test_a_damaged_meta_json_is_one_error_line(run_dir, tmp_path, capsys, case, change, needle, command):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    meta_path = run / "checkpoints" / "step_1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    if isinstance(change, dict):
        meta.update({k: v for k, v in change.items() if k != "drop"})
        meta.pop(change.get("drop", ""), None)
    else:
        meta = change
    meta_path.write_text(json.dumps(meta))
    argv = (["train", "--resume", str(run), "--steps", "2", "--quiet"] if command == "train" else
            ["generate", "--resume", str(run), "--prompt", "a", "--max-new-tokens", "2"])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err and "meta.json" in err, err
