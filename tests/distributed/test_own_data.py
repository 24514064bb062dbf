"""A folder of the user's own text end to end: `attnres-pp prepare` (several text files in folders and
a .jsonl, byte-level BPE) writes a data folder; `train --data` on it through the local launcher at
D = 2 takes the tokenizer's vocabulary and equals the single process; a run stopped after step 4
and resumed ends with the uninterrupted losses; `generate` answers in text, the decoding of its
token ids under the data folder's tokenizer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from attnres_pp.cli import main
from attnres_pp.data.tokenizer import Tokenizer
from tests.run_helpers import assert_same_losses, summary

pytestmark = pytest.mark.distributed  # rank processes of the local launcher

WORDS = ["def", "return", "self", "value", "print(", "):", "\n    ", "naïve", "x = 1", "# note"]
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "0", "--quiet"]


def test_prepare_train_at_d2_resume_and_generate_text(tmp_path, capsys):
    rng = np.random.default_rng(3)
    for i in range(5):
        folder = tmp_path / "mine" / ("src" if i % 2 else "notes")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}.txt").write_text(" ".join(rng.choice(WORDS, 300)), encoding="utf-8")
    (tmp_path / "extra.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(WORDS, 200))}) + "\n" for _ in range(3)), encoding="utf-8")
    data = tmp_path / "data"
    assert main(["prepare", "--input", str(tmp_path / "mine"), str(tmp_path / "extra.jsonl"), "--out", str(data),
                 "--vocab-size", "320", "--val-fraction", "0.25"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    tokenizer = Tokenizer.load(data)
    assert meta["documents"]["train"] + meta["documents"]["val"] == 8 and meta["tokenizer"] == "bpe"
    assert tokenizer.sha256 == meta["tokenizer_sha256"] and 256 < tokenizer.vocab_size <= 320

    single, run = tmp_path / "single", tmp_path / "run"
    common = [*TINY, "--data", str(data), "--stages", "1", "--checkpoint-every", "2", "--keep-checkpoints", "0"]
    assert main(["train", *common, "--steps", "6", "--launcher", "inprocess", "--out", str(single)]) == 0
    assert main(["train", *common, "--steps", "6", "--launcher", "local", "--data-parallel", "2",
                 "--out", str(run)]) == 0
    want, got = summary(single), summary(run)
    assert got["config"]["model"]["vocab_size"] == tokenizer.vocab_size
    assert got["config"]["pipeline"]["data_parallel"] == 2 and got["data"]["tokenizer_sha256"] == tokenizer.sha256
    assert_same_losses(got["losses"], want["losses"])

    resumed = tmp_path / "resumed"  # the run as a crash after step 5 leaves it: step_4 complete
    shutil.copytree(run / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    (resumed / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:5]))
    assert main(["train", "--resume", str(resumed), "--quiet"]) == 0
    assert summary(resumed)["losses"] == got["losses"]

    capsys.readouterr()
    assert main(["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "12",
                 "--temperature", "0", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out.splitlines()[0])
    assert answer["tokenizer"] == "bpe" and answer["prompt_ids"] == tokenizer.encode("def ")
    assert len(answer["tokens"]) == 12 and answer["text"] == tokenizer.decode(answer["tokens"])
