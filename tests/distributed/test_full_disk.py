"""A full disk under the local launcher, for real: `--out` on a tmpfs that holds the first checkpoint
of a two-rank-process run but not the second. The ranks' DCP save fails with ENOSPC inside a
CheckpointException (a BaseException, which a rank's `except Exception` missed, so it died and the
driver restarted the run into the same failure); now each rank reports the fault as data and the
driver stops with one `error:` line, exit code 2, no restart, the last complete checkpoint intact."""

from __future__ import annotations

import subprocess

import pytest

from attnres_pp.cli import main
from attnres_pp.train.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]

TWO_RANKS = ["--launcher", "local", "--stages", "2", "--layers", "2", "--d-model", "32", "--heads", "2",
             "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--steps", "4", "--checkpoint-every", "2",
             "--eval-every", "0", "--max-restarts", "3"]
# One checkpoint of this model is about 750 KiB (parameters and AdamW moments of both ranks): room for
# step_2 and the run's small files, not for step_4 beside it.
TMPFS_SIZE = "1200k"


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"needs to mount a small tmpfs (root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_full_disk_during_a_rank_save_is_one_line_without_restart(small_disk, capsys):
    run = small_disk / "run"
    capsys.readouterr()
    assert main(["train", *TWO_RANKS, "--out", str(run)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (f"error: no space left on device writing checkpoint {run / 'checkpoints' / 'step_4'} (the "
                   f"filesystem at {small_disk}): free space or give another --out; the last complete checkpoint "
                   f"step_2 stays resumable (attnres-pp train --resume {run})\n")
    assert "restart" not in out, out  # the ranks were not taken for lost
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == \
        ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]  # no step trained twice
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert latest_checkpoint(run) == run / "checkpoints" / "step_2"
