"""SingleProcessEngine: the whole model in this process (`--launcher local` with one chunk and one
replica). A global batch is split into microbatches along the batch axis and their gradients are
accumulated, so `microbatches = m` computes the same step as a pipeline with m microbatches (and,
up to float rounding, the same as m = 1)."""

from __future__ import annotations

import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.data import Corpus, batch_at, load_corpus, val_batch_at, val_batches
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
from attnres_pp.model.routing import RoutingProbe, attach_probe, routing_metrics
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.memory_meter import ActivationMeter, optional_saving
from attnres_pp.pipeline.meter_steps import MeterSteps, batch_signature, figures_can_change
from attnres_pp.train.background_save import ONE_PROCESS_TIMEOUT_S
from attnres_pp.train.config import TrainConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.memory_report import grad_bytes, memory_entry
from attnres_pp.train.optim import build_optimizer, optimizer_step
from attnres_pp.train.shard_saves import ShardSaves
from attnres_pp.train.shards import rng_stream


class SingleProcessEngine(ShardSaves):
    """Implements the `Engine` protocol of `attnres_pp.train.loop` in one process.

    Sets this process's torch thread count to `train_cfg.threads`; the initial weights are a function
    of `train_cfg.seed` and each parameter's name (`model.layers.init_weights`; drawn on the CPU,
    then moved: the same weights on any device). `train_cfg.device` "auto" takes the GPU if one is
    visible; `self.train_cfg` holds the resolved device, dtype and kernels."""

    timeout_s = ONE_PROCESS_TIMEOUT_S  # bounds a background checkpoint write
    # True: the meter runs on every step, the slow twin of `pipeline.meter_steps` (as `StageRuntime`'s).
    meter_every_step = False

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, *, corpus: Corpus | None = None) -> None:
        torch.set_num_threads(train_cfg.threads)
        self.resolved = resolve_run(PipelineConfig(launcher="local"), device=train_cfg.device, dtype=train_cfg.dtype,
                                    kernels=train_cfg.kernels, gpus=visible_gpus())
        train_cfg = train_cfg.decided(self.resolved)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg  # device, dtype and kernels resolved
        self.device = torch.device(self.resolved.device)
        self.model = Transformer(model_cfg, seed=train_cfg.seed, backend=train_cfg.kernels,
                                 precision=train_cfg.dtype, compile=train_cfg.compile).to(self.device)
        self.optimizer = build_optimizer(self.model, train_cfg, fused=self.device.type == "cuda",
                                         router_lr_scale=model_cfg.moe_router_lr_scale)
        self._corpus = corpus
        # Checkpointed layers run through one chunk that is the whole model (the pipeline's own code
        # path, `pipeline.activation_checkpoint`); without checkpointing, the model's forward.
        self._whole = None
        if train_cfg.activation_checkpoint != "none":
            self._whole = PipelineChunk(self.model, make_partition(model_cfg.n_layers, 1, 1), 0,
                                        self.model.stream_convs, train_cfg.activation_checkpoint)
        self.memory = ActivationMeter()  # what the forwards save for backward (docs/spec.md section 8)
        # The meter runs while the step's figure can change (`pipeline.meter_steps`).
        self._meter_steps = MeterSteps(every_step=figures_can_change([self.model], False) is not None)

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            self._corpus = load_corpus(self.train_cfg.data)
        return self._corpus

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        """One optimiser step on the global batch (None: the run's batch of `step`, read from the
        data); returns its mean loss (the mean of the equal-size microbatch losses) and the pre-clip
        gradient norm as a per-step metric."""
        if inputs_BT is None:
            inputs_BT, targets_BT = batch_at(self.corpus.train_tokens_N, step, self.train_cfg.batch_size,
                                             self.model_cfg.seq_len, self.train_cfg.seed)
        m = self.train_cfg.microbatches
        if inputs_BT.shape[0] % m:
            raise ValueError(f"global batch of {inputs_BT.shape[0]} sequences does not split into {m} microbatches")
        self.model.train()
        total_loss = 0.0
        inputs_BT, targets_BT = inputs_BT.to(self.device), targets_BT.to(self.device)
        metered = self._meter_steps.start(batch_signature([inputs_BT], [targets_BT])) or self.meter_every_step
        meter = self.memory if metered else None
        if metered:
            self.memory.set_excluded(self.model.parameters())
            self.memory.reset_peak()
        set_aux_scale(self.model, 1.0 / m)
        for inputs_bT, targets_bT in zip(inputs_BT.chunk(m), targets_BT.chunk(m), strict=True):
            if self._whole is None:
                with optional_saving(meter):
                    loss = self.model(inputs_bT, targets_bT)
            else:
                loss = self._whole({}, inputs_bT, targets_bT, meter=meter)[1]
            (loss / m).backward()
            total_loss += float(loss.detach())
        held_grad_bytes = grad_bytes(self.model.parameters())  # before the optimizer step drops them
        activation_peak_bytes = self._meter_steps.finish(self.memory.peak_bytes if metered else None)
        grad_norm = optimizer_step(self.optimizer, self.model.parameters(), lr, self.train_cfg.grad_clip)
        memory = memory_entry(self.model.parameters(), self.optimizer, grad_bytes=held_grad_bytes,
                              activation_peak_bytes=activation_peak_bytes,
                              cache_peak_bytes=0, device=self.device)
        moe_extras, moe_metrics = self._balance_experts()
        return StepResult(loss=total_loss / m, metrics={"grad_norm": grad_norm, **moe_metrics},
                          extras={"memory_per_rank": [memory], **moe_extras})

    def _balance_experts(self) -> tuple[dict, dict]:
        """The MoE sublayers' loads of the step: the aux-free bias moves, and the step's MoE figures."""
        moes = moe_sublayers(self.model)
        if not moes:
            return {}, {}
        loads_LE = take_loads(moes)
        update_expert_bias(moes, loads_LE)
        return expert_load_stats({name: load_E.tolist() for name, load_E in zip(moes, loads_LE, strict=True)},
                                 [take_aux(moes)])

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        self.model.eval()
        loss = float(self.model(inputs_BT.to(self.device), targets_BT.to(self.device)))
        self.model.train()
        return loss

    def evaluate(self) -> float:
        """Mean loss over the run's fixed validation batches (equal sizes: the mean of means is exact)."""
        train = self.train_cfg
        batches = val_batches(self.corpus.val_tokens_N, train.eval_batches, train.batch_size,
                              self.model_cfg.seq_len, train.seed)
        return sum(self.eval_loss(inputs_BT, targets_BT) for inputs_BT, targets_BT in batches) / len(batches)

    @torch.no_grad()
    def routing_metrics(self) -> dict:
        """Routing entropy and embedding weight per site on validation batch 0 (`--log-routing-every`)."""
        train = self.train_cfg
        inputs_BT, _ = val_batch_at(self.corpus.val_tokens_N, 0, train.batch_size, self.model_cfg.seq_len, train.seed)
        probe = RoutingProbe(self.model_cfg)
        self.model.eval()
        with attach_probe(self.model, probe):
            self.model(inputs_BT.to(self.device))
        self.model.train()
        return routing_metrics([probe.token_sums()])

    # The engine's checkpoint calls are this process's rank's (`ShardSaves`): the whole model, one shard.
    def save_checkpoint(self, step_dir) -> None:
        self.save_shard(step_dir)

    def begin_checkpoint(self, step_dir) -> float:
        return self.begin_save(step_dir)

    def checkpoint_written(self) -> bool:
        return self.save_written()

    def finish_checkpoint(self) -> None:
        self.finish_save()

    def load_checkpoint(self, step_dir) -> None:
        self.load_shard(step_dir)

    @property
    def params(self) -> dict:
        return dict(self.model.named_parameters())

    @property
    def rng_stream(self) -> str:
        """The RNG stream of the whole model in one process: replica 0, every layer (`train.shards`)."""
        return rng_stream(0, [range(self.model_cfg.n_layers)])

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        """Nothing to release in one process."""
