"""LocalEngine: the whole model in this process. A global batch is split into microbatches along
the batch axis and their gradients are accumulated, so `microbatches = m` computes the same step
as a pipeline with m microbatches (and, up to float rounding, the same as m = 1)."""

from __future__ import annotations

import torch

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.train.checkpoint import capture_state, read_checkpoint, restore_state, write_rank_file
from attnres_pp.train.config import TrainConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.optim import build_optimizer, optimizer_step


class LocalEngine:
    """Implements the `Engine` protocol of `attnres_pp.train.loop` in one process.

    Sets this process's torch thread count to `train_cfg.threads` and seeds torch with
    `train_cfg.seed` before building the model, so the initial weights are a function of the seed
    (built on CPU, then moved: the same weights on any device). `train_cfg.device` "auto" takes
    the GPU if one is visible; `self.train_cfg` holds the resolved device, dtype and kernels."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
        torch.set_num_threads(train_cfg.threads)
        torch.manual_seed(train_cfg.seed)
        decision = decide_device(train_cfg.device, n_ranks=1, one_process=True, gpus=visible_gpus())
        train_cfg = resolve_train(train_cfg, decision.device)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg  # device, dtype and kernels resolved
        self.device = torch.device(decision.device)
        self.model = Transformer(model_cfg, backend=train_cfg.kernels, precision=train_cfg.dtype).to(self.device)
        self.optimizer = build_optimizer(self.model, train_cfg, fused=self.device.type == "cuda")

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        """One optimiser step on the global batch; returns its mean loss (the mean of the equal-size
        microbatch losses) and the pre-clip gradient norm as a per-step metric."""
        m = self.train_cfg.microbatches
        if inputs_BT.shape[0] % m:
            raise ValueError(f"global batch of {inputs_BT.shape[0]} sequences does not split into {m} microbatches")
        self.model.train()
        total_loss = 0.0
        inputs_BT, targets_BT = inputs_BT.to(self.device), targets_BT.to(self.device)
        for inputs_bT, targets_bT in zip(inputs_BT.chunk(m), targets_BT.chunk(m), strict=True):
            loss = self.model(inputs_bT, targets_bT)
            (loss / m).backward()
            total_loss += float(loss.detach())
        grad_norm = optimizer_step(self.optimizer, self.model.parameters(), lr, self.train_cfg.grad_clip)
        return StepResult(loss=total_loss / m, metrics={"grad_norm": grad_norm})

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        self.model.eval()
        return float(self.model(inputs_BT.to(self.device), targets_BT.to(self.device)))

    def save_checkpoint(self, step_dir) -> None:
        """One process, so one rank file: rank_0.pt (see attnres_pp.train.checkpoint)."""
        write_rank_file(step_dir, 0, capture_state(dict(self.model.named_parameters()), self.optimizer))

    def load_checkpoint(self, step_dir) -> None:
        merged, rng_by_rank = read_checkpoint(step_dir)
        restore_state(merged, dict(self.model.named_parameters()), self.optimizer, rng_by_rank.get(0))

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        """Nothing to release in one process."""
