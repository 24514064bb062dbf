"""`attnres-pp export` as a command: a run on a BPE data folder carries its tokenizer into the folder
(transformers' tokenizer gives the run's ids), and every mistake is one `error:` line, exit 2,
nothing written (no folder, no half-assembled one beside it)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.data.tokenizer import END_OF_TEXT, Tokenizer
from tests.export.export_helpers import assert_same_logits, export, load_hf, ours_from_run, tokens, train

WORDS = "the quick brown fox jumps over a lazy dog while alpha beta gamma delta sing".split()


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    rng = random.Random(0)
    docs = [{"text": " ".join(rng.choice(WORDS) for _ in range(50))} for _ in range(40)]
    (root / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    assert main(["prepare", "--input", str(root / "docs.jsonl"), "--out", str(root / "data"), "--vocab-size", "300",
                 "--val-fraction", "0.2"]) == 0
    return root, train(root / "run", "--data", str(root / "data"), "--residual", "standard")


def test_a_bpe_run_exports_its_tokenizer(bpe_run, capsys):
    root, run = bpe_run
    capsys.readouterr()
    folder = export(run, root / "hf")
    assert "tokenizer: the run's BPE" in capsys.readouterr().out
    ours = Tokenizer.load(root / "data")
    from transformers import AutoTokenizer  # here, not at collection: ~2 s that only this test needs

    theirs = AutoTokenizer.from_pretrained(str(folder))
    text = "the lazy fox sings\n\nover gamma, quickly"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    assert theirs.eos_token == END_OF_TEXT and theirs.eos_token_id == ours.eot_id is not None
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == ours.eot_id
    assert_same_logits(ours_from_run(run), load_hf(folder), tokens(300, 2, 16))


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bytes") / "run", "--residual", "attnres")


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_a_non_empty_out_folder_is_refused_and_left_as_it_was(byte_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "not empty" in _refused(capsys, ["export", "--resume", str(byte_run), "--out", str(out)])
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_an_empty_out_folder_is_filled(byte_run, tmp_path):
    (tmp_path / "hf").mkdir()
    assert (export(byte_run, tmp_path / "hf") / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing left beside it


@pytest.mark.parametrize("what, expected", [("no_checkpoint", "no complete checkpoint"),
                                            ("missing", "no such directory"),
                                            ("shard_size", "not a size"),
                                            ("window", "--window 0: give at least 1")])
def test_bad_inputs_are_refused_with_nothing_written(byte_run, tmp_path, capsys, what, expected):
    run, flags = byte_run, []
    if what == "no_checkpoint":
        run = tmp_path / "empty_run"
        assert main(["train", "--launcher", "local", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len",
                     "8", "--steps", "1", "--batch-size", "1", "--microbatches", "1", "--quiet", "--eval-every", "0",
                     "--no-final-checkpoint", "--out", str(run)]) == 0
    elif what == "missing":
        run = tmp_path / "nowhere"
    elif what == "window":
        flags = ["--window", "0"]
    else:
        flags = ["--max-shard-size", "lots"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert expected in _refused(capsys, ["export", "--resume", str(run), "--out", str(tmp_path / "hf"), *flags])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_window_is_the_configs_sliding_window(byte_run, tmp_path):
    """The remote code's attention window: generate's default (seq_len 16) unless --window says."""
    for name, flags, window in (("default", [], 16), ("set", ["--window", "5"], 5)):
        config = json.loads((export(byte_run, tmp_path / name, *flags) / "config.json").read_text())
        assert config["sliding_window"] == window and config["seq_len"] == 16


def test_a_window_for_a_builtin_class_is_refused(bpe_run, tmp_path, capsys):
    """LlamaForCausalLM keeps no window (docs/export.md): --window is one error line, nothing written."""
    _root, run = bpe_run
    err = _refused(capsys, ["export", "--resume", str(run), "--out", str(tmp_path / "hf"), "--window", "8"])
    assert "LlamaForCausalLM" in err and "no sliding window" in err
    assert list(tmp_path.iterdir()) == []


def test_the_written_weights_are_the_checkpoints(byte_run, tmp_path):
    from safetensors.torch import load_file

    from attnres_pp.generate.cli import find_checkpoint, load_checkpoint

    folder = export(byte_run, tmp_path / "hf")
    _, named = load_checkpoint(find_checkpoint(str(byte_run)))
    written = load_file(folder / "model.safetensors")
    assert set(written) == set(named) and all(torch.equal(written[n], t) for n, t in named.items())


def test_a_damaged_checkpoint_is_one_error_line(byte_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(byte_run, run)
    step = run / "checkpoints" / "step_2"
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    err = _refused(capsys, ["export", "--resume", str(run), "--out", str(tmp_path / "hf")])
    assert "truncated" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_a_failed_write_leaves_nothing_not_even_the_folders_it_made(byte_run, tmp_path, capsys, monkeypatch):
    import attnres_pp.export.weights as weights

    def disk_full(tensors, out, max_bytes):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "write_weights", disk_full)
    err = _refused(capsys, ["export", "--resume", str(byte_run), "--out", str(tmp_path / "a" / "b" / "hf")])
    assert "No space left on device" in err
    assert list(tmp_path.iterdir()) == []
