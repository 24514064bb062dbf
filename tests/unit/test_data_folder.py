"""Training and generation on a data folder (the layout `attnres-pp prepare` writes, made here by a
test helper so these tests stand without it): memory-mapped multi-shard windows are those of the
concatenated stream, `train --data DIR` takes its vocabulary from meta.json and trains exactly like
the concatenated `.bin` of the same tokens, bad folders are one `error:` line, a resume (also into
another D) ends like the uninterrupted run and refuses another tokenizer, and `generate` reads and
writes text with the run's copy of the tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from attnres_pp.cli import main
from attnres_pp.data import batch_at, load_corpus, val_batch_at
from attnres_pp.data.token_folder import ShardedTokens, open_token_folder
from attnres_pp.data.tokenizer import END_OF_TEXT, Tokenizer
from tests.run_helpers import REPO, assert_same_losses, summary

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "0", "--launcher", "local", "--quiet"]


def documents() -> list[str]:
    return [p.read_text() for p in sorted((REPO / "attnres_pp" / "data").glob("*.py"))] * 2


def train_bpe(path: Path, texts: list[str], vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    bpe.save(str(path))


def write_folder(folder: Path, kind: str = "bpe", shard_tokens: int = 1000, dtype: str = "uint16",
                 tokenizer_json: Path | None = None, texts: list[str] | None = None) -> np.ndarray:
    """A data folder of `texts` (default `documents()`), its stream cut into train (the first 90%)
    and val shards; returns the whole stream (train then val) for comparisons."""
    folder.mkdir(parents=True)
    texts = texts or documents()
    if kind == "bpe":
        if tokenizer_json is None:
            train_bpe(folder / "tokenizer.json", texts)
        else:
            shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
        tok = Tokenizer.load(folder / "tokenizer.json")
        ids = []
        for text in texts:
            ids += tok.encode(text) + [tok.eot_id]
    else:
        tok = Tokenizer.raw_bytes()
        ids = list(b"\n".join(t.encode() for t in texts))
    stream = np.array(ids, dtype=dtype)
    n_val = max(1, int(len(stream) * 0.1))  # the split a .bin of the stream gets (data.corpus)
    meta = {"format": "attnres-pp-tokens", "version": 1, "tokenizer": kind, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "dtype": dtype, "eot_id": tok.eot_id, "seed": 0, "val_fraction": 0.1,
            "shard_tokens": shard_tokens, "documents": {"train": len(texts), "val": 0},
            "tokens": {}, "input_bytes": sum(len(t.encode()) for t in texts), "shards": {}}
    for split, part in (("train", stream[:-n_val]), ("val", stream[-n_val:])):
        meta["tokens"][split] = len(part)
        meta["shards"][split] = []
        for i, start in enumerate(range(0, len(part), shard_tokens)):
            name = f"{split}_{i:05d}.bin"
            part[start:start + shard_tokens].tofile(folder / name)
            meta["shards"][split].append({"file": name, "tokens": len(part[start:start + shard_tokens])})
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return stream


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> tuple[Path, np.ndarray]:
    folder = tmp_path_factory.mktemp("data") / "bpe"
    return folder, write_folder(folder)


def test_sharded_windows_equal_the_concatenated_stream(tmp_path):
    """Shards of 7 tokens, so that nearly every window of 17 crosses a boundary (windows may: see
    ShardedTokens); a batch, a replica's rows of it, a validation batch and slices all match."""
    stream = write_folder(tmp_path / "f", kind="bytes", shard_tokens=7, texts=["".join(documents())[:1500]] * 2)
    folder = open_token_folder(tmp_path / "f")
    assert folder.train.n_shards > 300
    whole = np.concatenate([np.asarray(folder.train), np.asarray(folder.val)])
    assert np.array_equal(whole, stream)
    train = stream[:len(folder.train)]
    for step in range(5):
        for rows in (None, range(2, 4)):
            got = batch_at(folder.train, step, 4, 16, seed=3, rows=rows)
            want = batch_at(train, step, 4, 16, seed=3, rows=rows)
            assert all(np.array_equal(g.numpy(), w.numpy()) for g, w in zip(got, want, strict=True))
    got, want = val_batch_at(folder.val, 0, 4, 16, 3), val_batch_at(stream[len(train):], 0, 4, 16, 3)
    assert np.array_equal(got[0].numpy(), want[0].numpy())
    for lo, hi in ((0, 7), (5, 30), (6, 8), (len(train) - 9, len(train))):
        assert np.array_equal(folder.train[lo:hi], train[lo:hi])
    index = np.array([[0, 6, 7], [13, 14, len(train) - 1]])
    assert np.array_equal(folder.train[index], train[index])
    assert folder.train[-1] == train[-1]
    # One shard, or a view over one in-memory array, indexes the same way.
    assert np.array_equal(ShardedTokens([train])[index], train[index])


def test_train_on_a_folder_takes_its_vocab_and_equals_the_concatenated_bin(tmp_path, bpe_folder):
    folder, stream = bpe_folder
    binary = tmp_path / "tokens.bin"
    stream.astype(np.uint16).tofile(binary)
    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    assert main(["train", *TINY, "--steps", "3", "--data", str(folder), "--out", str(tmp_path / "dir")]) == 0
    assert main(["train", *TINY, "--steps", "3", "--data", str(binary), "--vocab-size", str(vocab),
                 "--out", str(tmp_path / "bin")]) == 0
    got, want = summary(tmp_path / "dir"), summary(tmp_path / "bin")
    assert got["config"]["model"]["vocab_size"] == vocab
    assert got["losses"] == want["losses"] and got["val_loss"] == want["val_loss"]
    tokenizer = Tokenizer.load(folder)
    assert got["data"]["folder"] == str(folder.resolve())
    assert got["data"]["tokenizer_sha256"] == tokenizer.sha256 and got["data"]["tokenizer"] == "bpe"
    kept = tmp_path / "dir" / "tokenizer.json"  # generation needs the run alone
    assert kept.read_bytes() == (folder / "tokenizer.json").read_bytes()
    position = json.loads((tmp_path / "dir" / "checkpoints" / "step_3" / "meta.json").read_text())["data_position"]
    assert position["tokenizer_sha256"] == tokenizer.sha256 and position["folder"] == str(folder.resolve())
    assert position["replicas"] == [{"dp_rank": 0, "rows": [0, 4], "next_step": 3}]
    # The same vocabulary given explicitly is fine.
    assert main(["train", *TINY, "--steps", "1", "--data", str(folder), "--vocab-size", str(vocab),
                 "--out", str(tmp_path / "given")]) == 0


def _break(folder: Path, how: str) -> str:
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    if how == "no-meta":
        meta_path.unlink()
        return "no " + str(meta_path)
    if how == "short-shard":
        shard = folder / "train_00001.bin"
        shard.write_bytes(shard.read_bytes()[:-2])
        return "train_00001.bin is 1998 bytes"
    if how == "missing-shard":
        (folder / "val_00000.bin").unlink()
        return "val_00000.bin is missing"
    if how == "format":
        meta["format"] = "nanogpt"
    elif how == "version":
        meta["version"] = 2
    elif how == "tokens-sum":
        meta["tokens"]["train"] += 1
        meta_path.write_text(json.dumps(meta))
        return "tokens.train"
    meta_path.write_text(json.dumps(meta))
    return "this program reads format 'attnres-pp-tokens' version 1"


@pytest.mark.parametrize("how", ["no-meta", "short-shard", "missing-shard", "format", "version", "tokens-sum",
                                 "vocab"])
def test_a_bad_folder_is_one_error_line(tmp_path, bpe_folder, capsys, how):
    folder = tmp_path / "copy"
    shutil.copytree(bpe_folder[0], folder)
    extra = []
    if how == "vocab":
        extra, needle = ["--vocab-size", "256"], "differs from the data folder's vocab_size"
    else:
        needle = _break(folder, how)
    assert main(["train", *TINY, "--steps", "1", "--data", str(folder), *extra, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_resume_is_exact_also_into_another_d_and_refuses_another_tokenizer(tmp_path, bpe_folder, capsys):
    """6 steps with checkpoints every 2 on a P = 2 in-process pipeline; copies of it as a run stopped
    after step 5 (resumed from step_4 at D = 1) and after step 3 (from step_2, at D = 2) leave it
    end with the uninterrupted run's losses. A data folder with another tokenizer is refused."""
    folder = bpe_folder[0]
    common = [*TINY, "--data", str(folder), "--launcher", "inprocess", "--stages", "2", "--virtual", "1"]
    run = tmp_path / "run"
    assert main(["train", *common, "--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "0",
                 "--out", str(run)]) == 0
    want = summary(run)["losses"]
    records = (run / "metrics.jsonl").read_text().splitlines(True)
    for name, step, flags in (("d1", 4, []), ("d2", 2, ["--data-parallel", "2"])):
        again = tmp_path / name
        shutil.copytree(run / "checkpoints" / f"step_{step}", again / "checkpoints" / f"step_{step}")
        (again / "metrics.jsonl").write_text("".join(records[:step + 1]))
        assert main(["train", "--resume", str(again), *flags, "--quiet"]) == 0
        got = summary(again)
        assert_same_losses(got["losses"], want)
        assert (again / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert got["config"]["pipeline"]["data_parallel"] == 2
    position = json.loads((tmp_path / "d2" / "checkpoints" / "step_6" / "meta.json").read_text())["data_position"]
    assert [r["rows"] for r in position["replicas"]] == [[0, 2], [2, 4]]

    capsys.readouterr()
    for vocab in (300, 290):  # the same documents under another tokenizer, of the same or another size
        other = tmp_path / f"other{vocab}"
        train_bpe(tmp_path / f"t{vocab}.json", documents()[:2], vocab_size=vocab)
        write_folder(other, tokenizer_json=tmp_path / f"t{vocab}.json")
        assert main(["train", "--resume", str(run), "--steps", "8", "--data", str(other), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "tokenizer" in err and len(err.strip().splitlines()) == 1, err


def test_a_forged_data_position_is_refused(tmp_path, bpe_folder, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--data", str(bpe_folder[0]), "--out", str(run)]) == 0
    meta_path = run / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["data_position"]["replicas"][0]["rows"] = [0, 3]
    meta_path.write_text(json.dumps(meta))
    assert main(["train", "--resume", str(run), "--steps", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "data position is inconsistent" in err


def test_byte_folder_reads_like_text(tmp_path):
    write_folder(tmp_path / "bytes", kind="bytes")
    corpus = load_corpus(str(tmp_path / "bytes"))
    assert corpus.vocab_size == 256 and corpus.tokenizer_sha256 == "bytes" and corpus.folder


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_generate_reads_and_writes_text_with_the_runs_tokenizer(tmp_path, bpe_folder, capsys):
    """A run on a BPE folder generates after the folder is gone (the run keeps the tokenizer): the
    text is the decoding of its token ids, the prompt is encoded, `--stop` cuts on the decoded text,
    and a run tokenizer that is not the recorded one is refused."""
    folder = tmp_path / "moved"
    shutil.copytree(bpe_folder[0], folder)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--data", str(folder), "--out", str(run)]) == 0
    shutil.rmtree(folder)
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    common = ["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "10", "--temperature", "0",
              "--json"]
    assert main(common) == 0
    full = _json_lines(capsys.readouterr().out)[0]
    assert full["tokenizer"] == "bpe" and full["prompt_ids"] == tokenizer.encode("def ")
    assert full["prompt_tokens"] == len(full["prompt_ids"]) and len(full["tokens"]) == 10
    assert full["text"] == tokenizer.decode(full["tokens"])

    stop = full["text"][3:5]
    assert stop
    cut = full["text"].index(stop)
    assert main([*common, "--stop", stop]) == 0
    captured = capsys.readouterr()
    stopped = _json_lines(captured.out)[0]
    assert stopped["text"] == full["text"][:cut] and "stopped at" in captured.err
    assert stopped["tokens"] == full["tokens"][:len(stopped["tokens"])]
    assert stopped["text"].startswith(tokenizer.decode(stopped["tokens"]))

    assert main([*common[:-1]]) == 0  # plain text output: the decoded text
    assert capsys.readouterr().out == full["text"] + "\n"

    (run / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes() + b" ")
    assert main(common) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not the" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.distributed
def test_local_rank_processes_at_d2_read_the_folder(tmp_path, bpe_folder):
    """Two rank processes (D = 2, P = 1) each open the folder and read their rows of every batch; the
    run equals the single-process one on the same global batch."""
    folder = bpe_folder[0]
    assert main(["train", *TINY, "--steps", "3", "--data", str(folder), "--out", str(tmp_path / "one")]) == 0
    assert main(["train", *TINY, "--steps", "3", "--data", str(folder), "--data-parallel", "2", "--stages", "1",
                 "--out", str(tmp_path / "d2")]) == 0
    got = summary(tmp_path / "d2")
    assert got["config"]["pipeline"]["data_parallel"] == 2 and got["config"]["pipeline"]["launcher"] == "local"
    assert_same_losses(got["losses"], summary(tmp_path / "one")["losses"])
    assert got["data"]["tokenizer_sha256"] == Tokenizer.load(folder).sha256
