"""The parity tests' slow twin of a training run: the whole `Transformer` in this process, stepped by
its own forward and backward, with none of the product's engine, ranks or pipeline runtime. A global
batch is split into m microbatches along the batch axis and their gradients accumulated, the loss
is the mean of the microbatch losses, and the step is the product's one optimiser step
(`train.optim`): what every pipelined step must equal."""

from __future__ import annotations

import torch

from attnres_pp.data import Corpus, load_corpus, val_batches
from attnres_pp.launch.resolve import resolve_run, visible_gpus
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.moe import (
    expert_load_stats,
    moe_sublayers,
    set_aux_scale,
    take_aux,
    take_loads,
    update_expert_bias,
)
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train.config import TrainConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.optim import build_optimizer, optimizer_step


class WholeModel:
    """`train_step(step, inputs_BT, targets_BT, lr)` (a driver-fed batch), `eval_loss`, `evaluate`
    and `model`, as the engine offers them; device, dtype and kernels decided as a one-process run's."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, *, corpus: Corpus | None = None) -> None:
        torch.set_num_threads(train_cfg.threads)
        resolved = resolve_run(PipelineConfig(launcher="local"), device=train_cfg.device, dtype=train_cfg.dtype,
                               kernels=train_cfg.kernels, gpus=visible_gpus())
        self.train_cfg = train_cfg.decided(resolved)
        self.model_cfg = model_cfg
        self.device = torch.device(resolved.device)
        self.model = Transformer(model_cfg, seed=train_cfg.seed, backend=self.train_cfg.kernels,
                                 precision=self.train_cfg.dtype).to(self.device)
        self.optimizer = build_optimizer(self.model, self.train_cfg, fused=self.device.type == "cuda",
                                         router_lr_scale=model_cfg.moe_router_lr_scale)
        self._corpus = corpus

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        """One optimiser step on the global batch: its mean loss, the pre-clip gradient norm and,
        with MoE sublayers, their loads (`moe_expert_loads`) and figures."""
        del step  # the batch is given
        m = self.train_cfg.microbatches
        self.model.train()
        set_aux_scale(self.model, 1.0 / m)
        total_loss = 0.0
        for inputs_bT, targets_bT in zip(inputs_BT.to(self.device).chunk(m), targets_BT.to(self.device).chunk(m),
                                         strict=True):
            loss = self.model(inputs_bT, targets_bT)
            (loss / m).backward()
            total_loss += float(loss.detach())
        grad_norm = optimizer_step(self.optimizer, self.model.parameters(), lr, self.train_cfg.grad_clip)
        extras, metrics = {}, {}
        moes = moe_sublayers(self.model)
        if moes:
            loads_LE = take_loads(moes)
            update_expert_bias(moes, loads_LE)
            extras, metrics = expert_load_stats(
                {name: load_E.tolist() for name, load_E in zip(moes, loads_LE, strict=True)}, [take_aux(moes)])
        return StepResult(loss=total_loss / m, metrics={"grad_norm": grad_norm, **metrics}, extras=extras)

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """The whole batch's mean loss in one forward."""
        self.model.eval()
        loss = float(self.model(inputs_BT.to(self.device), targets_BT.to(self.device)))
        self.model.train()
        return loss

    def evaluate(self) -> float:
        """Mean loss over the run's fixed validation batches (equal sizes: the mean of means is exact)."""
        corpus = self._corpus if self._corpus is not None else load_corpus(self.train_cfg.data)
        train = self.train_cfg
        batches = val_batches(corpus.val_tokens_N, train.eval_batches, train.batch_size, self.model_cfg.seq_len,
                              train.seed)
        return sum(self.eval_loss(inputs_BT, targets_BT) for inputs_BT, targets_BT in batches) / len(batches)

    def close(self) -> None:
        """Nothing to release."""
