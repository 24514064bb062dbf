"""The driver's device decision: which device and process-group backend every rank gets, and what
"auto" means for the run's dtype and kernels there. Workers receive the resolved TrainConfig and
never decide for themselves.

    one process (single, inprocess)   cuda if a GPU is visible, else cpu (no process group)
    local launcher, D x P ranks       nccl and GPU r % count for global rank r when the node has
                                      >= D x P GPUs (each rank its own GPU), else gloo on cpu
    ray launcher, D x P ranks         nccl and one GPU per actor when the cluster has >= D x P GPUs;
                                      the ranks of one node then see all of that node's GPUs, each
                                      using its own (`ray_checks.node_gpu_views`), as Ray Train arranges, so
                                      NCCL can use peer-to-peer (NVLink) between them

`--device cuda` where the ranks cannot each have a GPU is refused with the reason (nccl cannot
share one GPU between ranks of a pipeline here); `--device cpu` always works (gloo).
"""

from __future__ import annotations

import dataclasses
import os

from attnres_pp.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class DeviceDecision:
    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl" | "none" (one process)


def visible_gpus() -> int:
    """CUDA GPUs this process can use (0 without CUDA, or with ATTNRES_PP_FORCE_CPU=1)."""
    if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def decide_device(requested: str, *, n_ranks: int, one_process: bool, gpus: int, where: str = "on this node",
                  data_parallel: int = 1) -> DeviceDecision:
    """`requested` "auto" | "cpu" | "cuda" for `n_ranks` ranks (D x P of them in a run of
    `data_parallel` = D replicas; one process hosts them all when `one_process`) given `gpus` GPUs
    (on the node for local processes, in the cluster for ray)."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={requested!r} is invalid: choose auto, cpu or cuda")
    if requested == "cpu":
        return DeviceDecision("cpu", "none" if one_process else "gloo")
    needed = 1 if one_process else n_ranks
    if gpus >= needed:
        return DeviceDecision("cuda", "none" if one_process else "nccl")
    if requested == "cuda":
        if one_process or gpus == 0:
            raise ValueError(f"--device cuda needs a CUDA GPU{'' if one_process else ' for each pipeline rank'}, "
                             f"and none is visible {where}; use --device cpu (or auto)")
        fewer = (f"--stages {max(1, gpus)} or fewer" if data_parallel == 1 else
                 f"--data-parallel x --stages of {max(1, gpus)} or fewer (now {data_parallel} x "
                 f"{n_ranks // data_parallel})")
        raise ValueError(
            f"--device cuda runs {n_ranks} pipeline ranks with nccl, one GPU each, but {gpus} GPU(s) are visible "
            f"{where}: nccl cannot give two ranks one GPU here. Use --device cpu (gloo), {fewer}, "
            "or --launcher ray on a cluster with more GPUs"
        )
    return DeviceDecision("cpu", "none" if one_process else "gloo")


def resolve_train(train: TrainConfig, device: str) -> TrainConfig:
    """`train` with device, dtype and kernels resolved for `device`."""
    on_gpu = device == "cuda"
    if train.kernels == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--kernels triton runs the Triton kernels, which need a CUDA device here (or the slow "
                         "interpreter, TRITON_INTERPRET=1); use --kernels torch or auto on cpu")
    return dataclasses.replace(
        train,
        device=device,
        dtype=("bf16" if on_gpu else "fp32") if train.dtype == "auto" else train.dtype,
        kernels=("triton" if on_gpu else "torch") if train.kernels == "auto" else train.kernels,
    )


def backend_of(train: TrainConfig) -> str:
    """The process-group backend of a resolved TrainConfig's ranks."""
    if train.device == "auto":
        raise ValueError("TrainConfig.device is unresolved ('auto'): the driver resolves it (train.devices)")
    return "nccl" if train.device == "cuda" else "gloo"
