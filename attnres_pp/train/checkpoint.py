"""Checkpoints: `DIR/checkpoints/step_N/` after N completed steps, holding one `rank_{r}.pt` per
worker plus `meta.json` (steps done, config, the run's records so far).

Atomic by construction: everything is written into `step_N.tmp/` and the folder is renamed only
once complete, so a `step_N/` folder with a `meta.json` is always a whole checkpoint, and a crash
mid-save leaves only a `.tmp` (or `.old`) folder, which resuming removes (`remove_interrupted_saves`).

meta.json also records the run's checkpoint settings (`CheckpointConfig.settings`), so a
resumed run keeps saving at the same cadence: without them a second crash would lose every step
since the resume.

Rank files hold tensors and plain containers only and are read with
`torch.load(weights_only=True)`: loading never unpickles arbitrary objects. Parameters and
optimizer state are keyed by the whole model's parameter names (not by rank or position), so a
checkpoint loads into any engine and any split of the model into ranks; every rank simply takes
the names it owns. The driver writes and reads all files (ranks send their state to it), so a
multi-node run needs no shared file system: checkpoints live beside the driver's summary.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from attnres_pp.train.summary import write_json_atomic

FORMAT = 1
# Two, not one: a newest checkpoint damaged on disk afterwards still leaves a good one to load.
KEEP = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")
_INTERRUPTED_DIR = re.compile(r"^step_(\d+)\.(tmp|old)$")
# Rehearsal hook, like `--inject-failure`: with ATTNRES_PP_KILL_DURING_CHECKPOINT=N set, the process
# saving checkpoint step_N SIGKILLs itself after the rank files are written and before meta.json and
# the rename, the crash that atomic saves and resume must survive. For tests and drills only.
KILL_DURING_CHECKPOINT = "ATTNRES_PP_KILL_DURING_CHECKPOINT"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """every: save after every `every` steps (0 = never). resume: continue from the newest complete
    checkpoint in the run directory. max_restarts: lost workers the run recovers from before it stops."""

    every: int = 0
    resume: bool = False
    max_restarts: int = 3

    def __post_init__(self) -> None:
        for name in ("every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CheckpointConfig.{name}={value!r} is invalid: must be an integer >= 0")

    def settings(self) -> dict:
        """The run's settings, which a checkpoint's meta.json keeps as its "checkpointing" table for
        `--resume`. Not `resume`: that says how this process started, not how the run goes on."""
        return {"every": self.every, "max_restarts": self.max_restarts}

    @classmethod
    def from_settings(cls, table: dict, *, resume: bool) -> CheckpointConfig:
        """Build from a `settings()` table; missing keys (older checkpoints have none) take the defaults."""
        unknown = sorted(set(table) - {"every", "max_restarts"})
        if unknown:
            raise ValueError(f"checkpoint settings {unknown} are unknown to this version (known: every, "
                             "max_restarts): resume with the version that wrote the checkpoint")
        return cls(**table, resume=resume)


# ---- one rank's state ----

def capture_state(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    """This worker's parameters, optimizer state and RNG states as CPU tensors in plain dicts."""
    return {
        "format": FORMAT,
        "params": {name: p.detach().cpu().clone() for name, p in params.items()},
        "optimizer": _optimizer_state_by_name(optimizer, params),
        "rng": rng_state(),
    }


def restore_state(state: dict, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                  rng: dict | None) -> None:
    """Load the entries of a merged checkpoint `state` that this worker owns (see `read_checkpoint`)."""
    missing = sorted(set(params) - set(state["params"]))
    if missing:
        raise ValueError(f"the checkpoint has no values for parameters {missing[:5]}: it was written for "
                         "another model; resume with the model config it was saved with")
    with torch.no_grad():
        for name, p in params.items():
            saved = state["params"][name]
            if saved.shape != p.shape:
                raise ValueError(f"checkpoint parameter {name} has shape {tuple(saved.shape)}, the model "
                                 f"{tuple(p.shape)}: resume with the model config it was saved with")
            p.copy_(saved)
    _load_optimizer_state_by_name(optimizer, params, state["optimizer"])
    if rng is not None:
        set_rng_state(rng)


def _optimizer_state_by_name(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict:
    name_of = {id(p): name for name, p in params.items()}
    return {name_of[id(p)]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()}


def _load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                                  by_name: dict) -> None:
    # state_dict() numbers parameters in param_group order; rebuild that numbering from names.
    name_of = {id(p): name for name, p in params.items()}
    ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    missing = [name for name in ordered if name not in by_name]
    if missing and len(missing) != len(ordered):
        raise ValueError(f"the checkpoint has no optimizer state for parameters {missing[:5]}")
    current = optimizer.state_dict()
    state = {} if missing else {index: by_name[name] for index, name in enumerate(ordered)}
    # load_state_dict casts the moments to each parameter's device and dtype.
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def rng_state() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"torch": torch.get_rng_state(), "cuda": list(cuda)}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- files ----

def write_rank_file(step_dir: str | Path, pp_rank: int, state: dict) -> None:
    torch.save({**state, "pp_rank": pp_rank}, Path(step_dir) / f"rank_{pp_rank}.pt")


def read_checkpoint(step_dir: str | Path) -> tuple[dict, dict[int, dict]]:
    """Every rank file of `step_dir` merged: ({"params": by name, "optimizer": by name}, RNG by rank).
    Replicated (tied) parameters appear in several files with equal values; any copy will do."""
    merged: dict = {"params": {}, "optimizer": {}}
    rng_by_rank: dict[int, dict] = {}
    files = sorted(Path(step_dir).glob("rank_*.pt"))
    if not files:
        raise ValueError(f"checkpoint {step_dir} holds no rank_*.pt files")
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != FORMAT:
            raise ValueError(f"{path} has checkpoint format {state.get('format')!r}; this version reads {FORMAT}")
        merged["params"].update(state["params"])
        merged["optimizer"].update(state["optimizer"])
        rng_by_rank[int(state["pp_rank"])] = state["rng"]
    return merged, rng_by_rank


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


def read_meta(step_dir: str | Path) -> dict:
    return json.loads((Path(step_dir) / "meta.json").read_text())


def check_run_dir(out_dir: str | Path, resume: bool) -> None:
    """A fresh run must not write into a run directory that holds another run's checkpoints (a
    restart would load them); a resumed one needs one. Raises ValueError saying what to do."""
    latest = latest_checkpoint(out_dir)
    if resume and latest is None:
        raise ValueError(f"--resume {out_dir}: no complete checkpoint under {checkpoints_dir(out_dir)} "
                         "(runs save them with --checkpoint-every K)")
    if not resume and latest is not None:
        raise ValueError(f"{out_dir} already holds checkpoints of an earlier run ({latest.name}): continue "
                         f"it with --resume {out_dir}, or choose another --out")


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


def save_checkpoint(out_dir: str | Path, steps_done: int, engine, meta: dict) -> Path:
    """Write checkpoint `step_{steps_done}` atomically: the engine's rank files, then meta.json,
    then the rename. Keeps the newest KEEP checkpoints. Returns the final folder."""
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
    for _steps, path in _complete(out_dir)[:-KEEP]:
        shutil.rmtree(path, ignore_errors=True)
    return final
