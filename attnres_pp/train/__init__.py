"""Training: configs, optimiser and schedule, the one training loop, the one engine over rank groups
and the `attnres-pp train` command."""

from attnres_pp.train.config import RunConfig, TrainConfig
from attnres_pp.train.loop import Engine, StepResult, run_training
from attnres_pp.train.optim import build_optimizer, clip_grad_norm_, lr_at

__all__ = [
    "Engine",
    "RunConfig",
    "StepResult",
    "TrainConfig",
    "build_optimizer",
    "clip_grad_norm_",
    "lr_at",
    "run_training",
]
