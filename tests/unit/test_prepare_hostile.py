"""`attnres-pp prepare` on hostile input: a vocabulary the trainer cannot allocate, a FIFO, a symlink
loop or a dangling link as --input (and inside a folder), an unreadable file, a .jsonl line nested
100,000 deep, a long line without whitespace, and Ctrl-C. Each refusal is one `error:` line naming
the file (exit 2), each skipped path one `warning:` line, and nothing is left beside --out: no
DATA_DIR, no DATA_DIR.tmp-*."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from attnres_pp.cli import main
from attnres_pp.data import bpe_train
from attnres_pp.data import prepare as prepare_module
from attnres_pp.data.bpe_train import MAX_TRAIN_RUN, training_pieces


def run(capsys, tmp_path, inputs, *flags) -> tuple[int, list[str]]:
    """Exit code and stderr lines of `prepare` into tmp_path/out/data; asserts nothing is left beside it
    unless it succeeded."""
    out = tmp_path / "out" / "data"
    capsys.readouterr()
    status = main(["prepare", "--input", *map(str, inputs), "--out", str(out), *flags])
    err = capsys.readouterr().err.splitlines()
    if status != 0:
        leftovers = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []
        assert leftovers == [], leftovers
    return status, err


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.txt"
    path.write_text("hello world, a small document")
    return path


@pytest.mark.parametrize("vocab", [2**31, 2**32])
def test_a_vocabulary_the_trainer_cannot_allocate_is_refused_before_it_starts(vocab, tmp_path, capsys, good):
    status, err = run(capsys, tmp_path, [good], "--vocab-size", str(vocab))
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --vocab-size {vocab} is above 16,777,216, the most ids a BPE may have"), err


def test_a_fifo_a_symlink_loop_or_a_dangling_link_is_named_for_what_it_is(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "nowhere")
    for name, what in [("pipe.txt", "a FIFO (named pipe)"), ("loop.txt", "a symlink loop"),
                       ("dangling.txt", "a symlink to nothing")]:
        status, err = run(capsys, tmp_path, [tmp_path / name])
        assert status == 2 and err == [f"error: --input {tmp_path / name} is {what}, not a regular file or folder: "
                                       "give a file or a folder"], err


def test_inside_a_folder_they_are_skipped_with_a_warning_each(tmp_path, capsys, good):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("one document")
    os.mkfifo(folder / "pipe.txt")
    (folder / "loop.txt").symlink_to(folder / "loop.txt")
    status, err = run(capsys, tmp_path, [folder], "--tokenizer", "bytes")
    assert status == 0, err
    skipped = f"warning: --input {folder}: skipped {folder}"
    assert err == [f"{skipped}/loop.txt: it is a symlink loop, not a regular file",
                   f"{skipped}/pipe.txt: it is a FIFO (named pipe), not a regular file"]
    assert '"train": 1' in (tmp_path / "out" / "data" / "meta.json").read_text()


def test_an_unreadable_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch, good):
    """Root reads a file whatever its mode bits, so the refusal of the open is injected."""
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    real_open = os.open

    def refuse(path, flags, *args, **kwargs):
        if os.fspath(path) == str(locked):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(locked))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    status, err = run(capsys, tmp_path, [good, locked])
    assert status == 2 and err == [f"error: {locked} cannot be read: Permission denied"], err


def test_a_jsonl_line_nested_100000_deep_is_one_line_naming_it(tmp_path, capsys):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    status, err = run(capsys, tmp_path, [deep])
    assert status == 2 and len(err) == 1 and err[0].startswith(f"error: {deep} line 2 is nested too deeply"), err


def test_long_runs_reach_the_trainer_in_bounded_pieces():
    text = "start " + "x" * 1000 + " middle" + " " * 600 + "end"
    pieces = list(training_pieces([text, "short"]))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "short"
    assert max(map(len, pieces)) == MAX_TRAIN_RUN
    assert pieces[:2] == ["start ", "x" * MAX_TRAIN_RUN]  # the run, cut where it begins
    normal = "ordinary words " * 100
    assert list(training_pieces([normal])) == [normal]  # text without long runs passes whole


def test_a_long_line_without_whitespace_trains_in_seconds(tmp_path, capsys, monkeypatch):
    """200 KB of letters in one line: 21 s of training as one word on this machine's 2 shared cores
    (the trainer's merges cost about the square of a word's length), 0.03 s in pieces."""
    line = tmp_path / "line.txt"
    line.write_text("".join(chr(97 + (i * 7919) % 26) for i in range(200_000)))
    seen: list[int] = []
    cut = bpe_train.training_pieces
    monkeypatch.setattr(bpe_train, "training_pieces", lambda texts: (seen.append(len(t)) or t for t in cut(texts)))
    started = time.monotonic()
    status, err = run(capsys, tmp_path, [line], "--vocab-size", "300")
    assert status == 0, err
    assert time.monotonic() - started < 15
    assert sum(seen) == 200_000 and max(seen) == MAX_TRAIN_RUN  # what the trainer saw: the line, in pieces


def test_ctrl_c_while_encoding_leaves_nothing(tmp_path, capsys, monkeypatch, good):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "encode_into", interrupted)  # DATA_DIR.tmp-* exists by now
    status, err = run(capsys, tmp_path, [good], "--tokenizer", "bytes")
    assert status == 130 and err == [f"interrupted: nothing written to {tmp_path / 'out' / 'data'}"], err


def test_ctrl_c_while_the_trainer_merges_stops_within_a_second(tmp_path, capsys, monkeypatch):
    """A real SIGINT while the library merges (it runs in Rust and does not look at signals): one run
    of 60 KB handed whole, a few seconds of merging."""
    line = tmp_path / "line.txt"
    line.write_text("".join(chr(97 + (i * 7919) % 26) for i in range(60_000)))
    monkeypatch.setattr(bpe_train, "training_pieces", lambda texts: texts)
    # Python's own SIGINT handler, as in a user's shell: a pytest-xdist worker ignores SIGINT.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        status, err = run(capsys, tmp_path, [line], "--vocab-size", "300")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    assert status == 130, err
    assert time.monotonic() - started < 1.5
