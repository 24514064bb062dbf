"""Corpora and batches: determinism, the split, text and uint16 sources, range checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnres_pp.data import batch_at, builtin_corpus_bytes, load_corpus, val_batches


@pytest.fixture(scope="module")
def builtin():
    return load_corpus("builtin")


def test_builtin_corpus_is_deterministic_and_split(builtin):
    again = load_corpus("builtin")
    assert np.array_equal(builtin.train_tokens_N, again.train_tokens_N)
    assert np.array_equal(builtin.val_tokens_N, again.val_tokens_N)
    assert builtin.n_tokens > 1_000_000
    whole = np.frombuffer(builtin_corpus_bytes(), dtype=np.uint8)
    # Disjoint and contiguous: validation is the tail of the stream, 10 % of it.
    n_val = len(builtin.val_tokens_N)
    assert np.array_equal(whole[:-n_val], builtin.train_tokens_N)
    assert np.array_equal(whole[-n_val:], builtin.val_tokens_N)
    assert 0.05 <= n_val / len(whole) <= 0.1
    assert builtin.max_token < 256
    assert b"def " in bytes(builtin.train_tokens_N[:100_000])


def test_same_seed_and_step_give_the_same_batch(builtin):
    x1, y1 = batch_at(builtin.train_tokens_N, 7, 4, 16, seed=3)
    x2, y2 = batch_at(builtin.train_tokens_N, 7, 4, 16, seed=3)
    assert x1.dtype == torch.int64 and x1.shape == (4, 16) and y1.shape == (4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


def test_batches_differ_across_steps_and_seeds(builtin):
    x0, _ = batch_at(builtin.train_tokens_N, 0, 4, 16, seed=0)
    x1, _ = batch_at(builtin.train_tokens_N, 1, 4, 16, seed=0)
    x0_other_seed, _ = batch_at(builtin.train_tokens_N, 0, 4, 16, seed=1)
    assert not torch.equal(x0, x1)
    assert not torch.equal(x0, x0_other_seed)


def test_batch_does_not_depend_on_history(builtin):
    direct, _ = batch_at(builtin.train_tokens_N, 5, 2, 8, seed=0)
    for step in range(5):
        batch_at(builtin.train_tokens_N, step, 2, 8, seed=0)
    after, _ = batch_at(builtin.train_tokens_N, 5, 2, 8, seed=0)
    assert torch.equal(direct, after)


def test_validation_batches_are_fixed(builtin):
    first = val_batches(builtin.val_tokens_N, 3, 2, 8, seed=0)
    second = val_batches(builtin.val_tokens_N, 3, 2, 8, seed=0)
    assert len(first) == 3
    for (xa, ya), (xb, yb) in zip(first, second, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(first[0][0], first[1][0])


def test_text_file_source(tmp_path):
    path = tmp_path / "tiny.txt"
    text = "héllo wörld, " * 200
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path))
    data = text.encode("utf-8")
    assert corpus.n_tokens == len(data)
    assert bytes(corpus.train_tokens_N) + bytes(corpus.val_tokens_N) == data
    x, y = batch_at(corpus.train_tokens_N, 0, 3, 10, seed=0)
    assert x.shape == (3, 10) and int(x.max()) < 256


def test_bin_file_source_and_vocab_check(tmp_path):
    tokens = (np.arange(5000) * 37 % 1000).astype(np.uint16)
    tokens[123] = 4000
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    corpus = load_corpus(str(path))
    assert corpus.max_token == 4000
    assert np.array_equal(np.concatenate([corpus.train_tokens_N, corpus.val_tokens_N]), tokens)
    x, y = batch_at(corpus.train_tokens_N, 2, 4, 32, seed=0)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match=r"vocab_size=256 .*vocab_size >= 4001"):
        corpus.check_fits(vocab_size=256, seq_len=32)
    corpus.check_fits(vocab_size=4001, seq_len=32)


def test_bad_sources_explain_the_fix(tmp_path):
    with pytest.raises(ValueError, match="TrainConfig.data.*builtin"):
        load_corpus(str(tmp_path / "data.csv"))
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="even"):
        load_corpus(str(odd))
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ValueError, match="seq_len=64 is too long"):
        load_corpus(str(short)).check_fits(vocab_size=256, seq_len=64)
