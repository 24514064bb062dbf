"""Checkpoints: `DIR/checkpoints/step_N/` after N completed steps, holding every rank's shard, written
by the ranks themselves with torch.distributed.checkpoint (`train.shards`: one `__R_0.distcp` file
per writing rank plus DCP's `.metadata`), and `meta.json` (steps done, config, the run's records so
far, tokens seen and the data position, the checkpoint settings, whether it is a run's final step).

A run saves every `every` steps and, unless `final` is off, at its last step: the trained model is
always on disk. Retention (`prune_checkpoints`) keeps the newest `keep_checkpoints` and never
deletes a final checkpoint.

A checkpoint becomes visible only complete (`save_checkpoint`): the ranks write their shards into
`step_N.tmp/` and each fsyncs its files before it reports done (DCP's FileSystemWriter with
`sync_files=True`); then the driver writes meta.json, the commit marker, fsyncs it and the
folder itself, renames it to `step_N` and fsyncs `checkpoints/`. A folder without
meta.json is not a checkpoint, and a `.tmp` never is. Replacing an existing `step_N` takes two
renames (`step_N` -> `step_N.old`, `step_N.tmp` -> `step_N`); a crash between them leaves the old
complete checkpoint as `step_N.old`, which `latest_checkpoint` counts when there is no complete
`step_N` and resuming renames back (`restore_replaced_checkpoints`). What else a crash leaves
(`.tmp`, a superseded `.old`) resuming removes (`remove_interrupted_saves`). Since the ranks write
directly, a run across several nodes needs `--out` on a filesystem every node sees (the engines
check at start).

meta.json also records the run's checkpoint settings (`CheckpointConfig.settings`), so a
resumed run keeps saving at the same cadence: without them a second crash would lose every step
since the resume.

Parameters and optimizer state are keyed by the whole model's parameter names (not by rank or
position), so a checkpoint loads into any engine and any split of the model into ranks (stages,
virtual stages, data parallelism, layer counts): every rank simply loads the names it holds, DCP
reading each from whichever shard has it. Loading unpickles nothing but tensors and DCP's metadata.
"""

from __future__ import annotations

import copy
import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.train.checkpoint_meta import read_meta
from attnres_pp.train.faults import rehearse_kill
from attnres_pp.train.summary import write_json_atomic

__all__ = ["read_meta"]  # re-exported: the loaders read meta.json through checkpoint_meta, beside this module

FORMAT = 2  # 1: rank_*.pt files written by the driver (before DCP shards)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_INTERRUPTED_DIR = re.compile(r"^step_(\d+)\.(tmp|old)$")
_REPLACED_DIR = re.compile(r"^step_(\d+)\.old$")
@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """every: save after every `every` steps (0 = only the final one). final: save after the run's
    last step too (`--no-final-checkpoint` turns it off). resume: continue from the newest complete
    checkpoint in the run directory. max_restarts: lost workers the run recovers from before it
    stops. async_save: the ranks write each checkpoint in the background while training goes on
    (`--async-checkpoint`, `begin_checkpoint`). How many checkpoints stay is
    `TrainConfig.keep_checkpoints` (TOML `[train]`)."""

    every: int = 0
    final: bool = True
    resume: bool = False
    max_restarts: int = 3
    async_save: bool = False

    def __post_init__(self) -> None:
        for name in ("every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CheckpointConfig.{name}={value!r} is invalid: must be an integer >= 0")
        if not isinstance(self.final, bool):
            raise ValueError(f"CheckpointConfig.final={self.final!r} is invalid: must be true or false "
                             "(false: no checkpoint of the last step, as --no-final-checkpoint)")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"CheckpointConfig.async_save={self.async_save!r} is invalid: must be true or false "
                             "(true: ranks write checkpoints in the background, as --async-checkpoint)")

    def settings(self) -> dict:
        """The run's settings, which a checkpoint's meta.json keeps as its "checkpointing" table for
        `--resume`. Not `resume`: that says how this process started, not how the run goes on."""
        return {"every": self.every, "final": self.final, "max_restarts": self.max_restarts,
                "async_save": self.async_save}

    @classmethod
    def from_settings(cls, table: dict, *, resume: bool) -> CheckpointConfig:
        """Build from a `settings()` table; missing keys (older checkpoints have none) take the defaults."""
        unknown = sorted(set(table) - set(SETTINGS))
        if unknown:
            raise ValueError(f"checkpoint settings {unknown} are unknown to this version (known: "
                             f"{', '.join(SETTINGS)}): resume with the version that wrote the checkpoint")
        return cls(**table, resume=resume)

    def saves_after(self, steps_done: int, steps: int) -> bool:
        """Whether the run saves a checkpoint once `steps_done` of its `steps` steps are done."""
        return bool(self.every and steps_done % self.every == 0) or (self.final and steps_done == steps)


SETTINGS = ("every", "final", "max_restarts", "async_save")


def checkpoints_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under `out_dir/checkpoints`, or None."""
    complete = _complete(out_dir)
    return complete[-1][1] if complete else None


def _complete(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(steps, folder) of every complete checkpoint, oldest first: each `step_N` with a meta.json,
    and a `step_N.old` with one where no complete `step_N` exists (a crash between the two renames
    of a save that replaced step_N left it; `restore_replaced_checkpoints` renames it back)."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    replaced: dict[int, Path] = {}
    for path in root.iterdir():
        if not (path / "meta.json").is_file():
            continue
        if m := _STEP_DIR.match(path.name):
            found[int(m.group(1))] = path
        elif m := _REPLACED_DIR.match(path.name):
            replaced[int(m.group(1))] = path
    for steps, path in replaced.items():
        found.setdefault(steps, path)
    return sorted(found.items())


def check_format(step_dir: str | Path) -> None:
    """Raise ValueError if `step_dir` was written in another checkpoint format than this version's."""
    found = read_meta(step_dir).get("format")
    if found != FORMAT:
        raise ValueError(f"checkpoint {step_dir} has format {found!r}, this version reads format {FORMAT} "
                         "(sharded, written by the ranks): resume it with the version that wrote it")


def check_run_dir(out_dir: str | Path, resume: bool) -> None:
    """A fresh run must not write into a run directory that holds another run's checkpoints (a
    restart would load them); a resumed one needs one. Raises ValueError saying what to do."""
    latest = latest_checkpoint(out_dir)
    if resume and latest is None:
        raise ValueError(f"--resume {out_dir}: no complete checkpoint under {checkpoints_dir(out_dir)} "
                         "(a run saves one at its last step unless --no-final-checkpoint, and every K steps "
                         "with --checkpoint-every K)")
    if not resume and latest is not None:
        raise ValueError(f"{out_dir} already holds checkpoints of an earlier run ({latest.name}): continue "
                         f"it with --resume {out_dir}, or choose another --out")
    if resume:
        # The driver reads the metadata first, under the same guarded unpickler the ranks use, so a
        # hostile or damaged file is one error line before any rank starts.
        # It also checks the tensors' names, shapes and dtypes against the model the config describes.
        from attnres_pp.train.checkpoint_check import check_expected
        from attnres_pp.train.shards import SafeReader, model_tensors

        metadata = SafeReader(latest).read_metadata()
        check_expected(metadata, model_tensors(latest, tensor_count=len(metadata.state_dict_metadata)), str(latest))


def restore_replaced_checkpoints(out_dir: str | Path) -> list[str]:
    """Rename each complete `step_N.old` back to `step_N` where no complete `step_N` exists (a crash
    came between the two renames of a save that replaced it; an incomplete `step_N` in its way is
    deleted); returns the restored names. Call it, like `remove_interrupted_saves` (and before it),
    only while no save is under way."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    restored = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        m = _REPLACED_DIR.match(path.name)
        if not m or not (path / "meta.json").is_file():
            continue
        final = root / f"step_{m.group(1)}"
        if (final / "meta.json").is_file():
            continue
        shutil.rmtree(final, ignore_errors=True)
        os.replace(path, final)
        fsync_path(root)
        restored.append(final.name)
    return restored


def remove_interrupted_saves(out_dir: str | Path) -> list[str]:
    """Delete the `step_N.tmp` and `step_N.old` folders a crash during `save_checkpoint` left under
    `out_dir/checkpoints`; returns their names. Resuming never reads them (it loads the newest
    complete `step_N`; run `restore_replaced_checkpoints` first, so that a `.old` that is the only
    complete copy of its step is renamed back instead), and nothing else removes a `.tmp` of a step
    the run does not save again. Call it only while no save is under way, i.e. before a resumed run
    starts."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    stale = sorted((path for path in root.iterdir() if _INTERRUPTED_DIR.match(path.name)), key=lambda p: p.name)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [path.name for path in stale]


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries, i.e. renames and new
    files, durable). A filesystem that cannot fsync a directory (EINVAL, ENOTSUP: some network
    ones) orders its entries itself, so that is let pass."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)



def stage_checkpoint(out_dir: str | Path, steps_done: int) -> Path:
    """An empty staging folder `step_N.tmp` for the save of checkpoint `step_{steps_done}` (an earlier
    attempt's leftover is removed). The ranks write their shards into it; `commit_checkpoint` makes
    it visible."""
    tmp = checkpoints_dir(out_dir) / f"step_{steps_done}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rehearse_kill("before-shards", steps_done)
    return tmp


def commit_checkpoint(out_dir: str | Path, steps_done: int, meta: dict, *, keep: int) -> Path:
    """Make the staged `step_N.tmp`, whose shards every rank has written and fsynced, the complete
    checkpoint `step_N`: meta.json, the commit marker, is written and fsynced with the folder, the
    folder renamed to `step_N` and `checkpoints/` fsynced. Then `prune_checkpoints(out_dir, keep)`.
    Returns the final folder."""
    root = checkpoints_dir(out_dir)
    final, tmp = root / f"step_{steps_done}", root / f"step_{steps_done}.tmp"
    rehearse_kill("before-meta", steps_done)
    write_json_atomic(tmp / "meta.json", {"format": FORMAT, "steps_done": steps_done, **meta})
    # The shards are durable already (each rank's DCP writer fsyncs them, `save_shard`): what the
    # driver wrote, meta.json, and the folder's entries are what is left before the rename.
    fsync_path(tmp / "meta.json")
    fsync_path(tmp)
    rehearse_kill("before-rename", steps_done)
    if final.exists():  # an earlier attempt at this step, or a leftover: the new one wins
        # No rename replaces a non-empty folder, so this takes two. Between them the old checkpoint,
        # if complete, is `step_N.old`, which latest_checkpoint counts while there is no step_N.
        old = root / f"step_{steps_done}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        rehearse_kill("between-renames", steps_done)
        os.replace(tmp, final)
        fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_path(root)
    prune_checkpoints(out_dir, keep)
    return final


def save_checkpoint(out_dir: str | Path, steps_done: int, engine, meta: dict, *, keep: int) -> Path:
    """Write checkpoint `step_{steps_done}` so that it becomes visible only complete: the ranks'
    shards into `step_N.tmp` (`engine.save_checkpoint`; each rank fsyncs its files), then
    `commit_checkpoint`. Returns the final folder."""
    tmp = stage_checkpoint(out_dir, steps_done)
    engine.save_checkpoint(tmp)
    return commit_checkpoint(out_dir, steps_done, meta, keep=keep)


@dataclass
class PendingCheckpoint:
    """An asynchronous save under way (`--async-checkpoint`): the ranks write `step_N.tmp` in the
    background while training goes on; `meta` is the run's state when the save began (what the
    shards hold), which `finish` commits once every rank's write is done."""

    out_dir: Path
    steps_done: int
    meta: dict
    keep: int

    def written(self, engine) -> bool:
        """Whether every rank has finished writing (and fsyncing) its shard."""
        return engine.checkpoint_written()

    def finish(self, engine) -> Path:
        """Wait for every rank's write (bounded by the ranks' timeout; a failed write raises), then
        commit. Returns the final folder."""
        engine.finish_checkpoint()
        return commit_checkpoint(self.out_dir, self.steps_done, self.meta, keep=self.keep)


def begin_checkpoint(out_dir: str | Path, steps_done: int, engine, meta: dict, *, keep: int) -> PendingCheckpoint:
    """Start saving checkpoint `step_{steps_done}` in the background: each rank copies its state
    (DCP's staging, so training may change the parameters at once) and writes it into `step_N.tmp`
    from a thread of its own. At most one save is in flight: a rank whose previous write is still
    running waits for it first. Nothing is visible until `PendingCheckpoint.finish` commits."""
    tmp = stage_checkpoint(out_dir, steps_done)
    engine.begin_checkpoint(tmp)
    # The run's lists (losses, step times) grow while the save runs: keep them as they are now.
    return PendingCheckpoint(Path(out_dir), steps_done, copy.deepcopy(meta), keep)


def prune_checkpoints(out_dir: str | Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all), never one whose meta.json
    says `"final": true` (written at the last step of a run: a run extended with `--resume --steps`
    keeps the model each of its legs ended with). Returns the deleted folders' names."""
    if keep == 0:
        return []
    removed = []
    for _steps, path in _complete(out_dir)[:-keep]:
        try:
            final = read_meta(path).get("final", False)
        except (OSError, ValueError):  # a meta.json damaged on disk: keep the folder for a person to look at
            continue
        if not final:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed
