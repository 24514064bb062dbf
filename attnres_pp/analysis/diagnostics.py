"""Routing diagnostics of one checkpoint: load it into the single-process model (checkpoints are keyed by
whole-model names, so any split loads here), evaluate K held-out batches of the run's own validation
data with a `model.routing.RoutingProbe` attached, and return the per-site statistics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from attnres_pp.data import load_corpus, val_batches
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.routing import RoutingProbe, attach_probe
from attnres_pp.train.checkpoint import checkpoints_dir, latest_checkpoint, read_meta
from attnres_pp.train.config import RunConfig
from attnres_pp.train.shards import read_parameters

_STEP_NAME = re.compile(r"step_\d+")


@dataclass(frozen=True, kw_only=True)
class LoadedRun:
    """A run's checkpoint in one process: its config, the step directory, and the model in eval mode."""

    run_dir: Path
    step_dir: Path
    run_cfg: RunConfig
    model: Transformer

    @property
    def model_cfg(self) -> ModelConfig:
        return self.run_cfg.model

    @property
    def steps_done(self) -> int:
        return int(read_meta(self.step_dir).get("steps_done", 0))


def find_checkpoint(run_dir: str | Path, name: str | None, flag: str = "RUN") -> Path:
    """RUN/checkpoints/NAME (`step_N`), or the newest complete one; ValueError saying what exists."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{flag} {run_dir} is not a directory: give the --out folder of a training run")
    if name is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise ValueError(f"{flag} {run_dir} has no complete checkpoint under {checkpoints_dir(run_dir)}: "
                             "a run saves its last step unless --no-final-checkpoint (and every K steps with "
                             "--checkpoint-every K); give a run that saved one")
        return found
    if not _STEP_NAME.fullmatch(name):
        raise ValueError(f"--checkpoint {name!r} is invalid: expected step_N, e.g. step_20")
    step_dir = checkpoints_dir(run_dir) / name
    if not (step_dir / "meta.json").is_file():
        names = sorted(p.name for p in checkpoints_dir(run_dir).glob("step_*") if (p / "meta.json").is_file())
        raise ValueError(f"--checkpoint {name}: {run_dir} has no such complete checkpoint; it has "
                         f"{', '.join(names) or 'none'}")
    return step_dir


def load_run(run_dir: str | Path, checkpoint: str | None = None, flag: str = "RUN") -> LoadedRun:
    """The run's model with the checkpoint's parameters, in float32 on the CPU, in eval mode."""
    step_dir = find_checkpoint(run_dir, checkpoint, flag)
    try:
        run_cfg = RunConfig.from_dict(read_meta(step_dir)["config"])
        params = read_parameters(step_dir)
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001  (a damaged checkpoint fails in torch.load, DCP or json)
        detail = (str(error).strip().splitlines() or [""])[-1]
        raise ValueError(f"checkpoint {step_dir} cannot be read ({type(error).__name__}: {detail})") from None
    model = Transformer(run_cfg.model, backend="torch", seed=run_cfg.train.seed)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    if missing:
        raise ValueError(f"checkpoint {step_dir} lacks parameters {missing[:3]} of its own model config")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(params[name].to(p.dtype))
    model.eval()
    return LoadedRun(run_dir=Path(run_dir), step_dir=step_dir, run_cfg=run_cfg, model=model)


@torch.no_grad()
def routing_diagnostics(run: LoadedRun, n_batches: int) -> list[dict]:
    """Per reading site (`RoutingProbe.summary`, in site order) over the first `n_batches` of the run's
    validation batches: the held-out data the run itself evaluated on."""
    if n_batches < 1:
        raise ValueError(f"--batches {n_batches} is invalid: give at least 1 held-out batch")
    train = run.run_cfg.train
    corpus = load_corpus(train.data)
    batches = val_batches(corpus.val_tokens_N, n_batches, train.batch_size, run.model_cfg.seq_len, train.seed)
    probe = RoutingProbe(run.model_cfg)
    with attach_probe(run.model, probe):
        for inputs_BT, _targets_BT in batches:
            run.model(inputs_BT)
    return probe.summary()


def held_out_loss(run: LoadedRun, n_batches: int) -> float:
    """Mean loss of the model over the first `n_batches` validation batches of its run."""
    train = run.run_cfg.train
    corpus = load_corpus(train.data)
    batches = val_batches(corpus.val_tokens_N, n_batches, train.batch_size, run.model_cfg.seq_len, train.seed)
    with torch.no_grad():
        return sum(float(run.model(i, t)) for i, t in batches) / len(batches)
