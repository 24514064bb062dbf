"""Checkpoints: `DIR/checkpoints/step_N/` after N completed steps, holding every rank's shard, written
by the ranks themselves with torch.distributed.checkpoint (`train.shards`: one `__R_0.distcp` file
per writing rank plus DCP's `.metadata`), and `meta.json` (steps done, config, the run's records so
far, tokens seen and the data position, the checkpoint settings, whether it is a run's final step).

A run saves every `every` steps and, unless `final` is off, at its last step: the trained model is
always on disk. Retention (`prune_checkpoints`) keeps the newest `keep_checkpoints` and never
deletes a final checkpoint.

meta.json is the commit marker: the driver writes it (atomically) only after every rank's save has
returned, and a folder without it is not a checkpoint. Saves also go into `step_N.tmp/`, renamed
once complete, so a crash mid-save leaves only a `.tmp` (or `.old`) folder, which resuming removes
(`remove_interrupted_saves`). Since the ranks write directly, a run across several nodes needs
`--out` on a filesystem every node sees (the engines check at start).

meta.json also records the run's checkpoint settings (`CheckpointConfig.settings`), so a
resumed run keeps saving at the same cadence: without them a second crash would lose every step
since the resume.

Parameters and optimizer state are keyed by the whole model's parameter names (not by rank or
position), so a checkpoint loads into any engine and any split of the model into ranks (stages,
virtual stages, data parallelism, layer counts): every rank simply loads the names it holds, DCP
reading each from whichever shard has it. Loading unpickles nothing but tensors and DCP's metadata.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.train.checkpoint_meta import read_meta
from attnres_pp.train.summary import write_json_atomic

__all__ = ["read_meta"]  # re-exported: the loaders read meta.json through checkpoint_meta, beside this module

FORMAT = 2  # 1: rank_*.pt files written by the driver (before DCP shards)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_INTERRUPTED_DIR = re.compile(r"^step_(\d+)\.(tmp|old)$")
# Rehearsal hook, like `--inject-failure`: with ATTNRES_PP_KILL_DURING_CHECKPOINT=N set, the process
# saving checkpoint step_N SIGKILLs itself after the ranks' shards are written and before meta.json and
# the rename, the crash that atomic saves and resume must survive. For tests and drills only.
KILL_DURING_CHECKPOINT = "ATTNRES_PP_KILL_DURING_CHECKPOINT"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """every: save after every `every` steps (0 = only the final one). final: save after the run's
    last step too (`--no-final-checkpoint` turns it off). resume: continue from the newest complete
    checkpoint in the run directory. max_restarts: lost workers the run recovers from before it
    stops. How many checkpoints stay is `TrainConfig.keep_checkpoints` (TOML `[train]`)."""

    every: int = 0
    final: bool = True
    resume: bool = False
    max_restarts: int = 3

    def __post_init__(self) -> None:
        for name in ("every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CheckpointConfig.{name}={value!r} is invalid: must be an integer >= 0")
        if not isinstance(self.final, bool):
            raise ValueError(f"CheckpointConfig.final={self.final!r} is invalid: must be true or false "
                             "(false: no checkpoint of the last step, as --no-final-checkpoint)")

    def settings(self) -> dict:
        """The run's settings, which a checkpoint's meta.json keeps as its "checkpointing" table for
        `--resume`. Not `resume`: that says how this process started, not how the run goes on."""
        return {"every": self.every, "final": self.final, "max_restarts": self.max_restarts}

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


SETTINGS = ("every", "final", "max_restarts")


def checkpoints_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under `out_dir/checkpoints`, or None."""
    complete = _complete(out_dir)
    return complete[-1][1] if complete else None


def _complete(out_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir()
             if (m := _STEP_DIR.match(path.name)) and (path / "meta.json").is_file()]
    return sorted(found)


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


def remove_interrupted_saves(out_dir: str | Path) -> list[str]:
    """Delete the `step_N.tmp` and `step_N.old` folders a crash during `save_checkpoint` left under
    `out_dir/checkpoints`; returns their names. Resuming never reads them (it loads the newest
    complete `step_N`), and nothing else removes a `.tmp` of a step the run does not save again.
    Call it only while no save is under way, i.e. before a resumed run starts."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    stale = sorted((path for path in root.iterdir() if _INTERRUPTED_DIR.match(path.name)), key=lambda p: p.name)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [path.name for path in stale]


def kill_during_checkpoint_step() -> int | None:
    """The step N of `ATTNRES_PP_KILL_DURING_CHECKPOINT` (see KILL_DURING_CHECKPOINT), or None if unset."""
    raw = os.environ.get(KILL_DURING_CHECKPOINT, "")
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = 0
    if step < 1:
        raise ValueError(f"{KILL_DURING_CHECKPOINT}={raw!r} is invalid: set it to the N of the checkpoint step_N "
                         "whose save should be killed (an integer >= 1), or unset it")
    return step


def save_checkpoint(out_dir: str | Path, steps_done: int, engine, meta: dict, *, keep: int) -> Path:
    """Write checkpoint `step_{steps_done}` atomically: the ranks' shards (`engine.save_checkpoint`),
    then meta.json, the commit marker, then the rename; then `prune_checkpoints(out_dir, keep)`.
    Returns the final folder."""
    root = checkpoints_dir(out_dir)
    final, tmp = root / f"step_{steps_done}", root / f"step_{steps_done}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    engine.save_checkpoint(tmp)
    if kill_during_checkpoint_step() == steps_done:
        os.kill(os.getpid(), signal.SIGKILL)
    write_json_atomic(tmp / "meta.json", {"format": FORMAT, "steps_done": steps_done, **meta})
    if final.exists():  # an earlier attempt at this step (before a restart): the new one wins
        old = root / f"step_{steps_done}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    prune_checkpoints(out_dir, keep)
    return final


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
