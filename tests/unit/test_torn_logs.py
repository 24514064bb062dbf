"""metrics.jsonl survives a crash: a full disk while logging (ENOSPC injected into the log's write,
half the line written first, as a real short write does) stops the run with one `error:` line
naming the disk and the last complete checkpoint, and leaves the file whole; a torn last line (what
a kill mid-write leaves) is ignored with one warning on `--resume`, which ends with the undisturbed
run's losses and leaves the file whole again."""

from __future__ import annotations

import errno
import json
import os

from attnres_pp.cli import main
from attnres_pp.train import summary as summary_module
from attnres_pp.train.summary import read_metrics
from tests.run_helpers import assert_same_losses, losses, metrics

TINY = ["--launcher", "local", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "1", "--eval-every", "3", "--steps", "8"]


def full_disk_at(call: int):
    """A `write_all` whose `call`-th write puts half its bytes on disk, then fails as a full disk does."""
    calls = {"n": 0}
    real = summary_module.write_all

    def write_all(fd: int, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == call:
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    return write_all


def test_full_disk_while_logging_then_a_torn_line_then_resume(tmp_path, capsys, monkeypatch):
    clean, run = tmp_path / "clean", tmp_path / "run"
    assert main(["train", *TINY, "--quiet", "--out", str(clean)]) == 0

    # Step 6's record (the 6th write) meets a full disk, after step_4 was saved.
    monkeypatch.setattr(summary_module, "write_all", full_disk_at(6))
    capsys.readouterr()
    assert main(["train", *TINY, "--checkpoint-every", "4", "--quiet", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: no space left on device writing {run / 'metrics.jsonl'} (the filesystem at "), err
    assert err.rstrip().endswith("free space or give another --out; the last complete checkpoint step_4 stays "
                                 f"resumable (attnres-pp train --resume {run})"), err
    # The half-written line was cut back: the file holds the five whole records and nothing else.
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4"]
    monkeypatch.undo()

    # What a kill in the middle of a write leaves: a torn last line, no newline.
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 5, "loss": 4.1')
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {run / 'metrics.jsonl'}: ignored its last line (23 bytes), a write a crash "
                        "cut short"], err
    assert [r["step"] for r in metrics(run)] == list(range(8))  # whole again: every line a record
    assert_same_losses(losses(run), losses(clean))
    assert_same_losses([r["loss"] for r in metrics(run)], losses(clean))


def test_read_metrics_tells_a_torn_tail_from_damage(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps({"step": i}) for i in range(4)]
    path.write_text("\n".join(whole) + "\n")
    assert read_metrics(path) == ([{"step": i} for i in range(4)], None)
    # A power cut can leave the tail as NUL bytes (size updated, data not): torn, like a cut line.
    path.write_text("\n".join(whole) + "\n" + "\0" * 12 + "\n")
    records, warning = read_metrics(path)
    assert len(records) == 4 and warning.endswith("ignored its last line (12 bytes), a write a crash cut short")
    # Damage inside the file (a line that is no record, one nested past the parser's depth) is
    # named by line number; the records around it are kept.
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text("\n".join([whole[0], "[1, 2]", whole[1], deep, whole[2]]) + "\n" + '{"step": 9')
    records, warning = read_metrics(path)
    assert records == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert warning == (f"{path}: ignored its last line (10 bytes), a write a crash cut short and 2 damaged "
                       "line(s) (2, 4)")
    assert read_metrics(tmp_path / "missing.jsonl") == ([], None)
