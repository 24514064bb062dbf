"""What `simulate plan` is asked (`PlanRequest`: the model, the batch, the cluster and the search's
bounds) and what it searches (`Candidate`: one training configuration; the GPUs are T x P x D)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import SPLIT_SCHEDULES
from attnres_pp.schedule.v_memory import V_MEMORY_SCHEDULES, closed_form_peak_held
from attnres_pp.simulator.memory import ATTENTION_KERNELS, DTYPE_BYTES
from attnres_pp.simulator.moe import check_expert_parallel
from attnres_pp.simulator.tensor_parallel import INTRA_NODE_LATENCY_US, TensorParallel, check_tensor_parallel

GIB = 1024 ** 3
SPLIT = SPLIT_SCHEDULES  # the schedules with a W store (the schedule package decides)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The model, the batch and the cluster to plan for (GB/s = 1e9 bytes/s; Gb/s = 1e9 bits/s)."""

    model: ModelConfig
    global_batch: int
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 3600.0
    inter_node_gbps: float = 400.0
    latency_us: float = 10.0
    tflops: float = 400.0
    peak_tflops: float = 989.0
    hbm_tbs: float = 3.0
    dtype: str = "bf16"
    block_size: int | None = None
    top: int = 5
    attention_kernel: str = "flash"  # GPUs run the flash / efficient kernels (memory.attention_correction)
    # T to search (docs/spec.md section 10; the CLI searches TP_SIZES unless --tensor-parallel fixes one);
    # sizes the model or the node does not allow are skipped, unless the one size is fixed: then refused.
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    sequence_parallel: bool = True  # under T > 1 (the tp terms are derived, docs/spec.md section 10)
    intra_node_latency_us: float = INTRA_NODE_LATENCY_US  # per ring step of a tp collective
    # EP to search (docs/spec.md section 12): None searches the powers of two dividing E and D (1 for a
    # dense model); a fixed size must divide both.
    expert_parallel: int | None = None

    def expert_parallel_sizes(self, data_parallel: int) -> list[int]:
        """The EP a layout with D replicas allows: `expert_parallel` if it divides E and D (none
        otherwise), else every power of two dividing both."""
        if not self.model.moe:
            return [1] if self.expert_parallel in (None, 1) else []
        if self.expert_parallel is not None:
            fits = self.model.moe_experts % self.expert_parallel == 0 and data_parallel % self.expert_parallel == 0
            return [self.expert_parallel] if fits else []
        sizes, ep = [], 1
        while self.model.moe_experts % ep == 0 and data_parallel % ep == 0:
            sizes.append(ep)
            ep *= 2
        return sizes

    def legal_tp_sizes(self) -> list[int]:
        """The T of `tensor_parallel_sizes` this model and cluster allow; ValueError naming the rule when
        one size is fixed and breaks it."""
        legal = []
        for t in self.tensor_parallel_sizes:
            tp = TensorParallel(t, self.sequence_parallel)
            try:
                check_tensor_parallel(self.model, tp, gpus_per_node=self.gpus_per_node)
                check_expert_parallel(self.model, 1, 1, t)  # MoE layers are priced at T = 1
                if self.gpus % t:
                    raise ValueError(f"--tensor-parallel {t} does not divide --gpus {self.gpus}: T x P x D "
                                     "must equal the GPUs")
            except ValueError:
                if len(self.tensor_parallel_sizes) == 1:
                    raise
                continue
            legal.append(t)
        return legal

    def __post_init__(self) -> None:
        for name in ("global_batch", "gpus", "gpus_per_node", "top"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: give an integer >= 1")
        if not self.tensor_parallel_sizes or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                                                 for t in self.tensor_parallel_sizes):
            raise ValueError(f"--tensor-parallel {self.tensor_parallel_sizes!r} is invalid: give integers >= 1")
        if not math.isfinite(self.intra_node_latency_us) or self.intra_node_latency_us < 0:
            raise ValueError(f"intra_node_latency_us {self.intra_node_latency_us!r} is invalid: give a finite "
                             "number >= 0")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "tflops", "peak_tflops", "hbm_tbs"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: give a finite number > 0")
        if self.expert_parallel is not None and (isinstance(self.expert_parallel, bool)
                                                 or not isinstance(self.expert_parallel, int)
                                                 or self.expert_parallel < 1):
            raise ValueError(f"--expert-parallel {self.expert_parallel!r} is invalid: give an integer >= 1")
        if self.expert_parallel not in (None, 1) and not self.model.moe:
            raise ValueError(f"--expert-parallel {self.expert_parallel} needs experts: give --moe-experts E")
        if self.expert_parallel and self.model.moe and self.model.moe_experts % self.expert_parallel:
            raise ValueError(f"--expert-parallel {self.expert_parallel} does not divide --moe-experts "
                             f"{self.model.moe_experts}: each EP rank holds E / EP routed experts")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r} is invalid: choose one of {', '.join(DTYPE_BYTES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"--attention-kernel {self.attention_kernel!r} is invalid: choose one of "
                             f"{', '.join(ATTENTION_KERNELS)}")


@dataclass(frozen=True)
class Candidate:
    """One configuration the plan prices: the schedule and its P, V, m, D, T, the block size, the cache, how
    the D replicas hold their state and the activation checkpointing (the flags of `attnres-pp train`)."""

    schedule: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    data_parallel: int
    block_size: int
    dp_shard: str
    activation_checkpoint: str
    cache: bool = True
    reshard_after_forward: str = "never"  # fsdp only: train's --fsdp-reshard-after-forward
    tensor_parallel: int = 1  # T (docs/spec.md section 10); the GPUs are T x P x D
    sequence_parallel: bool = False  # in effect only when T > 1
    expert_parallel: int = 1  # EP (docs/spec.md section 12): divides D and E

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(self.tensor_parallel, self.sequence_parallel)

    @property
    def sp(self) -> bool:
        return self.tp.sp



def closed_form_in_flight(schedule: str, n_stages: int, n_microbatches: int, n_first: int) -> int:
    """The chunk-microbatches rank 0 (holding `n_first` chunks) keeps in flight, in closed form, for
    the planner's first pass: P under 1F1B, about (V + 1) P interleaved, 3P under ZB-V's and
    DualPipeV's two chunks, all m x V under GPipe, and V-Half's and V-Min's bound (about a half and a
    third of ZB-V's, `v_memory.closed_form_peak_held`). The exact walk of the second pass counts them."""
    if schedule == "gpipe":
        return n_microbatches * n_first
    if schedule in V_MEMORY_SCHEDULES:
        return min(n_microbatches * n_first, closed_form_peak_held(schedule, n_stages))
    return min(n_microbatches * n_first, n_stages * (n_first + 1 if n_first > 1 else 1))
