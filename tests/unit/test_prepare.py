"""`attnres-pp prepare`: the data folder it writes (meta.json agrees with the shards, the shards
decode back to each split's documents, the split is by document and seeded) and its refusals (one
`error:` line, exit 2, no DATA_DIR and no .tmp folder left)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from attnres_pp.cli import main
from attnres_pp.data.prepare import token_dtype
from attnres_pp.data.tokenizer import Tokenizer

WORDS = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "eta,"]


def _corpus(root: Path) -> list[Path]:
    """Text files in nested folders and a .jsonl; the inputs to give."""
    rng = np.random.default_rng(0)
    for i in range(6):
        folder = root / "txt" / f"d{i % 2}" / ("deep" if i % 3 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, 40 + 10 * i)), encoding="utf-8")
    (root / "txt" / "skip.md").write_text("not matched by --glob")
    lines = [{"text": " ".join(rng.choice(WORDS, 30)), "id": j} for j in range(4)]
    (root / "more.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return [root / "txt", root / "more.jsonl"]


def _documents(root: Path) -> list[str]:
    files = sorted(p for p in (root / "txt").rglob("*.txt"))
    docs = [p.read_text(encoding="utf-8") for p in files]
    return docs + [json.loads(line)["text"] for line in (root / "more.jsonl").read_text().splitlines()]


def _run(inputs, out, *flags) -> int:
    return main(["prepare", "--input", *map(str, inputs), "--out", str(out), *flags])


def _split_ids(out: Path, meta: dict, split: str) -> np.ndarray:
    parts = [np.fromfile(out / s["file"], dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
             for s in meta["shards"][split]]
    for part, shard in zip(parts, meta["shards"][split], strict=True):
        assert len(part) == shard["tokens"] <= meta["shard_tokens"]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    inputs = _corpus(root)
    out = root / "data"
    assert _run(inputs, out, "--vocab-size", "300", "--shard-tokens", "97", "--val-fraction", "0.3") == 0
    return root, inputs, out


def test_meta_agrees_with_the_shards_and_they_decode_to_the_split_documents(prepared):
    root, _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "attnres-pp-tokens" and meta["version"] == 1 and meta["tokenizer"] == "bpe"
    tok = Tokenizer.load(out)
    assert (tok.sha256, tok.vocab_size, tok.eot_id) == (meta["tokenizer_sha256"], meta["vocab_size"], meta["eot_id"])
    assert meta["dtype"] == "uint16" and meta["documents"] == {"train": 7, "val": 3}
    docs = _documents(root)
    assert meta["input_bytes"] == sum(len(d.encode()) for d in docs)
    seen = []
    for split in ("train", "val"):
        ids = _split_ids(out, meta, split)
        assert len(ids) == meta["tokens"][split] and len(meta["shards"][split]) >= 1
        cuts = np.flatnonzero(ids == meta["eot_id"])
        pieces = np.split(ids, cuts)
        texts = [tok.decode([int(i) for i in p if i != meta["eot_id"]]) for p in pieces]
        assert len(texts) == meta["documents"][split]
        seen += texts
    assert sorted(seen) == sorted(docs)  # every document in exactly one split, whole


def test_same_seed_same_bytes_another_seed_another_split(prepared, tmp_path):
    _, inputs, out = prepared
    flags = ["--vocab-size", "300", "--shard-tokens", "97", "--val-fraction", "0.3"]
    assert _run(inputs, tmp_path / "again", *flags) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes()
                                                               for p in (tmp_path / "again").iterdir()}
    assert _run(inputs, tmp_path / "other", *flags, "--seed", "5") == 0
    val = (out / "val_00000.bin").read_bytes()
    assert (tmp_path / "other" / "val_00000.bin").read_bytes() != val


def test_bytes_tokenizer_writes_the_utf8_bytes_as_uint16(prepared, tmp_path):
    root, inputs, _ = prepared
    out = tmp_path / "bytes"
    assert _run(inputs, out, "--tokenizer", "bytes", "--shard-tokens", "500") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer"], meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("bytes", "uint16", 256, None)
    assert not (out / "tokenizer.json").exists()
    assert (out / "train_00000.bin").stat().st_size == 2 * 500
    # The documents hold newlines too: compare the byte counts, separators (one fewer than documents) included.
    written = np.concatenate([_split_ids(out, meta, s) for s in ("train", "val")])
    expected = np.frombuffer("".join(_documents(root)).encode() + b"\n" * (len(_documents(root)) - 2), np.uint8)
    assert written.max() < 256
    assert np.array_equal(np.bincount(written, minlength=256), np.bincount(expected, minlength=256))


def test_dtype_choice():
    assert token_dtype(256) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(2**32) == "uint32"
    with pytest.raises(ValueError):
        token_dtype(2**32 + 1)


def _bad(tmp_path: Path) -> dict[str, tuple[list, list]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "latin.txt").write_bytes(b"ok \xe9t\xe9")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "nokey.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "x.parquet").write_bytes(b"")
    good = tmp_path / "good.txt"
    good.write_text("hello world")
    cases = {
        "empty folder": ([tmp_path / "empty"], []),
        "no matching file": ([tmp_path / "blank"], ["--glob", "*.md"]),
        "only empty documents": ([tmp_path / "blank"], []),
        "not UTF-8": ([tmp_path / "latin.txt"], []),
        "vocab too small": ([good], ["--vocab-size", "256"]),
        "vocab above uint32": ([good], ["--vocab-size", str(2**32 + 1)]),
        "val fraction 0": ([good], ["--val-fraction", "0"]),
        "val fraction 1": ([good], ["--val-fraction", "1"]),
        "shard tokens 0": ([good], ["--shard-tokens", "0"]),
        "missing input": ([tmp_path / "nowhere.txt"], []),
        "jsonl not JSON": ([tmp_path / "bad.jsonl"], []),
        "jsonl lacks key": ([tmp_path / "nokey.jsonl"], []),
    }
    cases["parquet without pyarrow"] = ([good, tmp_path / "x.parquet"], [])
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return cases
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    latin = pa.array([b"ok", b"ok \xe9t\xe9"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": latin}), tmp_path / "latin.parquet")
    cases.update({
        "parquet not parquet": ([tmp_path / "x.parquet"], []),
        "parquet lacks column": ([tmp_path / "nocol.parquet"], []),
        "parquet int column": ([tmp_path / "ints.parquet"], []),
        "parquet not UTF-8": ([tmp_path / "latin.parquet"], []),
    })
    return cases


EXPECTED = {"not UTF-8": "byte offset 3", "jsonl not JSON": "line 2", "jsonl lacks key": "line 2",
            "missing input": "does not exist", "parquet without pyarrow": "pip install pyarrow",
            "parquet not parquet": "not a parquet file", "parquet lacks column": "no column 'text' (--text-key",
            "parquet int column": "the column 'text' is int64, not a string column",
            "parquet not UTF-8": "row 2 is not UTF-8 at byte offset 3"}


CASES = [*EXPECTED, "empty folder", "no matching file", "only empty documents", "vocab too small",
         "vocab above uint32", "val fraction 0", "val fraction 1", "shard tokens 0"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    cases = _bad(tmp_path)
    if case not in cases:
        pytest.skip("needs pyarrow")
    if case == "parquet without pyarrow":  # whether or not it is installed here
        for name in ("pyarrow", "pyarrow.parquet"):
            monkeypatch.setitem(sys.modules, name, None)
    inputs, flags = cases[case]
    out = tmp_path / "out" / "data"
    before = set(tmp_path.rglob("*"))
    assert _run(inputs, out, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert EXPECTED.get(case, "") in err[0]
    assert set(tmp_path.rglob("*")) == before  # no DATA_DIR, no .tmp, no parent made


def test_a_non_empty_out_is_refused(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("hello")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep").write_text("x")
    assert _run([tmp_path / "good.txt"], tmp_path / "data", "--tokenizer", "bytes") == 2
    assert "choose another --out or remove it" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "good.txt"]


HARD_DOCUMENTS = [
    "", " ", "  ", "x", " leading space", "  two leading spaces", "trailing space ", "trailing spaces  \n",
    "don't won't it's we're they've I'm you'll he'd 'S 'tis ' s", "DON'T Don't",
    "naïve café Ünïcödé 日本語のテキスト 中文 한국어 ελληνικά русский", "digits 123 4567 ١٢٣ ５６ 1.5e10 3,000",
    "emoji 😀😃 👩‍👩‍👧 🇫🇷 a😀b", "tabs\there\t\tand\t \tmixed", "new\nlines\n\n\nand \n spaces\n \n",
    "\r\nwindows\r\n lines\r\n", "punctuation!!! ??? ... --- ;;; (([[{{}}]])) \"quoted\" «guillemets»",
    "a" * 3000, " " + "averyveryverylongword" * 200, "mixed\u00a0nbsp \u3000ideographic \u2009thin \u180emongolian",
    "x \x1cfile \x1dsep \x85nel", "<|endoftext|>", "before <|endoftext|> after", "a<|endoftext|>b c",
    "zero\u200bwidth \u200bjoiner", "end with newline\n", " \t ", "\n", "a b  c   d    e",
]


def _trained(texts: list[str], vocab_size: int = 400):
    from attnres_pp.data.prepare import train_bpe

    return Tokenizer.from_json_bytes(train_bpe(texts, vocab_size))


def _fuzz_documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = list("ab cd  e\t\n'sS9é日😀!.,-") + ["\u00a0", "\u3000", "\x1c", "\u180e", "\r\n", "don't", " the",
                                                   "<|endoftext|>"]
    return ["".join(rng.choice(alphabet, rng.integers(0, 60))) for _ in range(n)]


def test_the_chunk_cache_gives_the_library_ids_on_hard_documents():
    from attnres_pp.data.bpe_cache import FastEncoder

    docs = HARD_DOCUMENTS + _fuzz_documents(400)
    tok = _trained(docs + [" ".join(WORDS) * 20])
    assert FastEncoder.usable(tok._bpe)
    expected = [tok._bpe.encode(text, add_special_tokens=False).ids for text in docs]
    encoder = FastEncoder(tok._bpe)
    for _ in range(2):  # cold (every chunk a miss) and warm (every chunk cached)
        parts = encoder.encode_batch(docs, np.uint32)
        assert [encoder.assemble([part], tok.eot_id, False, np.uint32).tolist() for part in parts] == expected
        joined = encoder.assemble(parts, tok.eot_id, True, np.uint32).tolist()
        assert joined == [i for ids in expected for i in (tok.eot_id, *ids)]
    encoder = FastEncoder(tok._bpe)  # one document at a time: other batches, other misses
    assert [encoder.assemble(encoder.encode_batch([text], np.uint32), tok.eot_id, False, np.uint32).tolist()
            for text in docs] == expected


def test_the_fast_path_writes_the_bytes_of_the_slow_one(tmp_path):
    root = tmp_path / "corpus"
    (root / "txt").mkdir(parents=True)
    for i, text in enumerate(HARD_DOCUMENTS + _fuzz_documents(60, seed=1)):
        (root / "txt" / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    from attnres_pp.data.prepare import prepare

    outs = {}
    for name, fast in (("fast", True), ("slow", False), ("fast_again", True)):
        outs[name] = tmp_path / name
        prepare([str(root / "txt")], outs[name], vocab_size=300, shard_tokens=101, val_fraction=0.3,
                log=lambda line: None, fast=fast)
    files = sorted(p.name for p in outs["slow"].iterdir())
    assert len(files) > 4
    for name in ("fast", "fast_again"):
        assert sorted(p.name for p in outs[name].iterdir()) == files
        for file in files:
            assert (outs[name] / file).read_bytes() == (outs["slow"] / file).read_bytes(), (name, file)


@pytest.mark.subprocess
def test_two_worker_processes_write_the_bytes_of_one(tmp_path):
    from attnres_pp.data import prepare as prepare_module
    from attnres_pp.data import prepare_encode

    root = tmp_path / "txt"
    root.mkdir()
    for i, text in enumerate(HARD_DOCUMENTS + _fuzz_documents(80, seed=2)):
        (root / f"doc{i:03d}.txt").write_text(text * 10, encoding="utf-8")
    # Enough input for the order to matter: dozens of 4 KiB jobs, more than the batch warmed before the fork.
    total = sum(p.stat().st_size for p in root.iterdir())
    assert total > 25 * 4096 and total > 5 * 20_000, total
    outs = {}
    for workers, warm in ((1, False), (2, False), (2, True)):
        outs[workers, warm] = tmp_path / f"w{workers}{warm}"
        saved = prepare_encode.WORKER_JOB_BYTES, prepare_encode.ENCODE_BATCH_BYTES, prepare_encode.WARM_BEFORE_FORK
        prepare_encode.WORKER_JOB_BYTES = 4096  # many jobs: order across them is what is tested
        prepare_encode.ENCODE_BATCH_BYTES = 20_000  # the batch warmed before the fork: a part of the input
        prepare_encode.WARM_BEFORE_FORK = warm
        try:
            prepare_module.prepare([str(root)], outs[workers, warm], vocab_size=300, shard_tokens=997,
                                   val_fraction=0.3, log=lambda line: None, workers=workers)
        finally:
            (prepare_encode.WORKER_JOB_BYTES, prepare_encode.ENCODE_BATCH_BYTES,
             prepare_encode.WARM_BEFORE_FORK) = saved
    files = sorted(p.name for p in outs[1, False].iterdir())
    for key in ((2, False), (2, True)):
        assert sorted(p.name for p in outs[key].iterdir()) == files
        for file in files:
            assert (outs[key] / file).read_bytes() == (outs[1, False] / file).read_bytes(), (key, file)


# Parquet inputs: pyarrow is in the data and dev extras, so CI runs these; the guard only spares a
# bare install.
PARQUET_TEXTS = ["first row", "", None, "naïve café 日本語 😀 👩‍👩‍👧", " leading space", "tabs\tand\nlines\n",
                 "<|endoftext|> inside", "ελληνικά русский", *(f"row {i} " + "word " * (i % 7) for i in range(23))]


def _write_parquet(path: Path, texts: list, arrow_type=None, row_group_size: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(texts, arrow_type or pa.string())
    table = pa.table({"id": list(range(len(texts))), "body": column})
    pq.write_table(table, path, row_group_size=row_group_size)
    assert pq.ParquetFile(path).metadata.num_row_groups == -(-len(texts) // row_group_size) > 1


def _write_jsonl(path: Path, texts: list) -> None:
    lines = [json.dumps({"body": text}) for text in texts if text is not None]  # a null row: no document
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _same_folders(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and "meta.json" in files
    for file in files:
        assert (a / file).read_bytes() == (b / file).read_bytes(), file


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_parquet_gives_the_tokens_of_the_same_texts_as_jsonl(tokenizer, tmp_path):
    pytest.importorskip("pyarrow")
    _write_parquet(tmp_path / "a.parquet", PARQUET_TEXTS)
    _write_parquet(tmp_path / "b.parquet", PARQUET_TEXTS[::-1], row_group_size=5)
    _write_jsonl(tmp_path / "a.jsonl", PARQUET_TEXTS)
    _write_jsonl(tmp_path / "b.jsonl", PARQUET_TEXTS[::-1])
    flags = ["--text-key", "body", "--tokenizer", tokenizer, "--shard-tokens", "173", "--val-fraction", "0.2",
             *(["--vocab-size", "300"] if tokenizer == "bpe" else [])]
    assert _run([tmp_path / "a.parquet", tmp_path / "b.parquet"], tmp_path / "from_parquet", *flags) == 0
    assert _run([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "from_jsonl", *flags) == 0
    _same_folders(tmp_path / "from_parquet", tmp_path / "from_jsonl")
    meta = json.loads((tmp_path / "from_parquet" / "meta.json").read_text())
    n_docs = sum(1 for text in PARQUET_TEXTS if text)  # the null row and the empty one are skipped
    assert sum(meta["documents"].values()) == 2 * n_docs


@pytest.mark.parametrize("kind", ["large_string", "dictionary"])
def test_parquet_large_and_dictionary_string_columns_read_as_text(kind, tmp_path):
    pa = pytest.importorskip("pyarrow")
    from attnres_pp.data.prepare_inputs import documents, find_sources

    arrow_type = pa.large_string() if kind == "large_string" else pa.dictionary(pa.int32(), pa.string())
    _write_parquet(tmp_path / "a.parquet", PARQUET_TEXTS, arrow_type)
    got = list(documents(find_sources([str(tmp_path / "a.parquet")], "*.txt"), "body", "strict"))
    assert got == [text for text in PARQUET_TEXTS if text]


def test_parquet_is_read_a_batch_at_a_time_in_order(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    from attnres_pp.data import prepare_inputs

    monkeypatch.setattr(prepare_inputs, "PARQUET_BATCH_ROWS", 3)
    texts = [f"document {i} é" for i in range(40)]
    _write_parquet(tmp_path / "a.parquet", texts, row_group_size=8)
    pulled = []
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            pulled.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("the whole file was read"))
    stream = prepare_inputs.documents(prepare_inputs.find_sources([str(tmp_path / "a.parquet")], "*"), "body",
                                      "strict")
    assert next(stream) == texts[0] and pulled == [3]  # one batch pulled for the first document
    assert [texts[0], *stream] == texts and sum(pulled) == 40 and max(pulled) <= 3


def test_parquet_not_utf8_is_replaced_with_errors_replace(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from attnres_pp.data.prepare_inputs import documents, find_sources

    raw = pa.array([b"ok", None, b"ok \xe9t\xe9"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": raw}), tmp_path / "latin.parquet")
    got = list(documents(find_sources([str(tmp_path / "latin.parquet")], "*"), "text", "replace"))
    assert got == ["ok", "ok \ufffdt\ufffd"]
