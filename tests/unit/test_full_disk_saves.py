"""A checkpoint save that the disk refuses stops the run in one `error:` line, exit code 2, no restart:
no space (ENOSPC injected into DCP's shard write of a one-process run, blocking and
`--async-checkpoint`, and of thread ranks) and no permission (a real immutable checkpoints/ folder mid-run, which root
cannot write either). The line names the cause, the checkpoint, the disk, the fix and the last
complete checkpoint; no partial step folder is left, and `--resume` once the folder is writable again
ends with the undisturbed run's losses. A rank reports such a failure as data: `find_storage_fault`
finds it inside DCP's CheckpointException (a BaseException) and through exception chains."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import subprocess

import pytest
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from attnres_pp.cli import main
from attnres_pp.launch.storage_fault import StorageFault, find_storage_fault, mount_point, out_of_space
from attnres_pp.train import loop
from attnres_pp.train.checkpoint import latest_checkpoint
from tests.run_helpers import assert_same_losses, losses

TINY = ["--launcher", "local", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "1", "--eval-every", "3", "--steps", "8", "--checkpoint-every", "4",
        "--quiet"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The undisturbed run's folder."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize("flags", [[], ["--async-checkpoint"], ["--launcher", "inprocess", "--stages", "2",
                                                                  "--microbatches", "2"]],
                         ids=["blocking", "async", "thread-ranks"])
def test_no_space_for_a_shard_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys, flags):
    run = tmp_path / "run"
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def full_at_step_8(self, path, mode):
        with real(self, path, mode) as stream:
            if str(path).endswith(".distcp") and "step_8.tmp" in str(path):
                stream.write(b"\0" * 64)  # some bytes land before the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full_at_step_8)
    capsys.readouterr()
    assert main(["train", *TINY, *flags, "--out", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"error: no space left on device writing checkpoint {run / 'checkpoints' / 'step_8'} "
                    f"(the filesystem at {mount_point(run)}): free space or give another --out; the last complete "
                    f"checkpoint step_4 stays resumable (attnres-pp train --resume {run})")
    # Nothing half-written is left beside the complete checkpoint; the run did not restart or finish.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4"]
    assert latest_checkpoint(run) == run / "checkpoints" / "step_4"
    assert not (run / "summary.json").exists()


def _immutable(path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True, capture_output=True, timeout=10)


@pytest.mark.subprocess
def test_an_unwritable_checkpoints_folder_mid_run_is_one_line_then_resume(tmp_path, monkeypatch, capsys, clean):
    """Root ignores permission bits; an immutable folder (chattr +i) refuses root too (EPERM)."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs) to make a folder unwritable for root")
    run = tmp_path / "run"
    root = run / "checkpoints"
    real = loop.save_checkpoint

    def save_then_lock(out_dir, steps_done, *args, **kwargs):
        saved = real(out_dir, steps_done, *args, **kwargs)
        _immutable(root, True)  # after step_4: the folder cannot take step_8
        return saved

    monkeypatch.setattr(loop, "save_checkpoint", save_then_lock)
    capsys.readouterr()
    try:
        status = main(["train", *TINY, "--out", str(run)])
    except subprocess.CalledProcessError as error:
        pytest.skip(f"this filesystem refuses chattr +i: {error.stderr.strip()}")
    finally:
        subprocess.run(["chattr", "-i", str(root)], capture_output=True, timeout=10)
    assert status == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"error: operation not permitted writing checkpoint {root / 'step_8'} (the filesystem at "
                    f"{mount_point(run)}): make it writable or give another --out; the last complete checkpoint "
                    f"step_4 stays resumable (attnres-pp train --resume {run})")
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]

    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    assert_same_losses(losses(run), losses(clean))


def test_a_storage_fault_is_found_inside_dcp_and_chains_and_crosses_a_pipe(tmp_path):
    disk = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    dcp_error = CheckpointException("write", {1: (RuntimeError("peer"), None), 0: (disk, None)})
    assert not isinstance(dcp_error, Exception)  # why a rank's `except Exception` missed it
    fault = find_storage_fault(dcp_error)
    assert (fault.code, fault.path, str(fault)) == (errno.ENOSPC, "/x/__0_0.distcp",
                                                    "no space left on device writing /x/__0_0.distcp")
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/ro")
        except OSError as inner:
            raise RuntimeError("the save failed") from inner
    except RuntimeError as chained:
        assert find_storage_fault(chained).reason == "permission denied"
    class TaskError(StorageFault):  # Ray's task error: a subclass of the carried class, fields on `cause`
        def __init__(self, cause: BaseException) -> None:
            Exception.__init__(self, "the task failed")
            self.cause = cause

    assert find_storage_fault(TaskError(StorageFault(errno.ENOSPC, "/d/x"))).path == "/d/x"
    copy = pickle.loads(pickle.dumps(StorageFault(errno.EROFS, "/ro/step_2")))
    assert (copy.code, copy.path, copy.fix) == (errno.EROFS, "/ro/step_2", "mount it writable")
    # Not a storage fault: other errnos, plain errors, and a cycle does not hang the search.
    assert find_storage_fault(OSError(errno.ENOTDIR, "Not a directory")) is None
    looped = RuntimeError("a")
    looped.__context__ = RuntimeError("b")
    looped.__context__.__context__ = looped
    assert find_storage_fault(looped) is None
    # torch's zip writer loses the errno of a full disk ("unexpected pos"): the disk is asked instead.
    assert out_of_space(tmp_path / "step_2.tmp", 1 << 62).code == errno.ENOSPC
    assert out_of_space(tmp_path / "step_2.tmp", 1) is None
