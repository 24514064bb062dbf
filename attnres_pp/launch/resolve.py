"""The run decided once: what device, backend, dtype and kernels its ranks use, which engine runs it
(this process alone, a rank group, or torchft replica groups), whether its ranks share this process,
and every refusal of a combination the flags ask for. `train`, `generate` and `analyze` call this
module; nothing below it decides these again: ranks and engines receive the `ResolvedRun` as data.

    device    cpu | cuda; auto is cuda when every rank can have its own GPU (one GPU for ranks that
              share this process), else cpu. The GPUs counted are where the ranks run: this node's
              for local processes and threads, the Ray cluster's once joined
    backend   gloo on cpu, nccl on cuda, none for one process
    dtype     auto is bf16 on cuda, fp32 on cpu
    kernels   auto is triton on cuda, torch on cpu (triton on cpu only under TRITON_INTERPRET=1)
    engine    single (one process, one rank in it: `--launcher local` with one chunk, one replica and
              T = 1), pipeline (a rank group), replicas (torchft replica groups, `--fault-tolerance
              replicas`)

`--device cuda` where the ranks cannot each have a GPU is refused with the reason (nccl cannot
share one GPU between the ranks of a pipeline here); `--device cpu` always works (gloo). Pure
standard library at import: torch is imported only to count GPUs.
"""

from __future__ import annotations

import dataclasses
import os

from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
KERNELS = ("auto", "torch", "triton")
ENGINES = ("single", "pipeline", "replicas")
# "replicas": each of the D pipelines is a torchft replica group (`train.ft_replicas`).
FAULT_TOLERANCES = ("off", "replicas")


@dataclasses.dataclass(frozen=True)
class DeviceDecision:
    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl" | "none" (one process)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """What a run is, with every "auto" decided: the engine builds it, ranks receive it."""

    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl" | "none"
    dtype: str  # "fp32" | "bf16"
    kernels: str  # "torch" | "triton"
    launcher: str
    engine: str  # one of ENGINES
    n_ranks: int  # D x P x T (1 for the single engine)
    ranks_in_this_process: bool  # the single engine, or --launcher inprocess threads

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") or self.dtype not in ("fp32", "bf16") \
                or self.kernels not in ("torch", "triton") or self.engine not in ENGINES:
            raise ValueError(f"ResolvedRun holds an undecided value: {self}")


def visible_gpus() -> int:
    """CUDA GPUs this process can use (0 without CUDA, or with ATTNRES_PP_FORCE_CPU=1)."""
    if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def single_process(pipe: PipelineConfig) -> bool:
    """Whether the run is this process alone: the local launcher with one chunk, one replica and no
    tensor parallelism (training's one rank in this process, generation's single generator)."""
    return pipe.launcher == "local" and pipe.is_single_process


def ranks_in_this_process(pipe: PipelineConfig) -> bool:
    """Whether every rank runs in this process: the single engine, or threads (`--launcher inprocess`)."""
    return pipe.launcher == "inprocess" or single_process(pipe)


def decide_device(requested: str, *, n_ranks: int, one_process: bool, gpus: int, where: str = "on this node",
                  data_parallel: int = 1) -> DeviceDecision:
    """The one place "auto" becomes a device. `requested` "auto" | "cpu" | "cuda" for `n_ranks`
    ranks (D x P x T of them in a run of `data_parallel` = D replicas; one process hosts them all
    when `one_process`) given `gpus` GPUs `where` the ranks run."""
    if requested not in DEVICES:
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


def decide_dtype(dtype: str, device: str) -> str:
    """`--dtype` on `device`: auto is bf16 on cuda and fp32 on cpu."""
    return ("bf16" if device == "cuda" else "fp32") if dtype == "auto" else dtype


def decide_kernels(kernels: str, device: str) -> str:
    """`--kernels` on `device`: auto is triton on cuda and torch on cpu; ValueError for triton on
    cpu outside the interpreter."""
    on_gpu = device == "cuda"
    if kernels == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--kernels triton runs the Triton kernels, which need a CUDA device here (or the slow "
                         "interpreter, TRITON_INTERPRET=1); use --kernels torch or auto on cpu")
    return ("triton" if on_gpu else "torch") if kernels == "auto" else kernels


def backend_of(device: str) -> str:
    """The process-group backend of ranks on a decided `device`."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is undecided: the launch layer decides it (launch.resolve)")
    return "nccl" if device == "cuda" else "gloo"


def engine_of(pipe: PipelineConfig, fault_tolerance: str = "off") -> str:
    """Which engine runs the run: one of ENGINES."""
    if fault_tolerance == "replicas":
        return "replicas"
    return "single" if single_process(pipe) else "pipeline"


def resolve_run(pipe: PipelineConfig, *, device: str, dtype: str, kernels: str, gpus: int,
                where: str = "on this node", fault_tolerance: str = "off") -> ResolvedRun:
    """The run of `pipe` with `--device/--dtype/--kernels` as asked, decided against `gpus` GPUs
    `where` its ranks run. Replica groups run on cpu (torchft's gloo group)."""
    engine = engine_of(pipe, fault_tolerance)
    here = ranks_in_this_process(pipe)
    n_ranks = 1 if engine == "single" else pipe.world_size
    if engine == "replicas":
        decision = DeviceDecision("cpu", "gloo")
    else:
        decision = decide_device(device, n_ranks=n_ranks, one_process=here, gpus=gpus, where=where,
                                 data_parallel=pipe.data_parallel)
    return ResolvedRun(device=decision.device, backend=decision.backend, dtype=decide_dtype(dtype, decision.device),
                       kernels=decide_kernels(kernels, decision.device), launcher=pipe.launcher, engine=engine,
                       n_ranks=n_ranks, ranks_in_this_process=here)


def check_tensor_parallel(cfg: ModelConfig, pipe: PipelineConfig, requested: str, *, gpus: int | None = None,
                          whose: str = "", training: bool = True) -> None:
    """ValueError, before any rank starts, for a T > 1 run that cannot start, naming the rule: the
    split (`ModelConfig.check_tensor_split`), a tp group larger than the node's GPUs, and what tensor
    parallelism runs on: rank processes, Ray actors (each tp group one bundle, so on one node) or
    in-process threads, over gloo on cpu; in training, FSDP2 over D replicas needs D to divide
    d_model (it shards the tp-split qkv weight's columns). `training` False: generation's rules
    (no sequence split, no FSDP). `requested` is `--device`; `gpus` the
    GPUs where the ranks run (None: this node's). Under Ray the engine checks again with the
    cluster's once joined, where "auto" may find GPUs."""
    t = pipe.tensor_parallel
    if t == 1:
        return
    # Generation splits each layer but never the sequence: its passes are a few tokens long.
    cfg.check_tensor_split(t, sequence_parallel=pipe.sp and training, whose=whose)
    if pipe.launcher == "ray" and gpus is None:
        # The cluster's GPUs are known once it is joined, where the engine checks again ("auto" may
        # find them there); cuda is refused already.
        device = "cuda" if requested == "cuda" else "cpu"
    else:
        on_node = visible_gpus() if gpus is None else gpus
        if requested == "cuda" and pipe.launcher != "ray":  # a Ray bundle per tp group keeps it on one node
            pipe.check_tensor_parallel_fits_node(on_node, "GPUs visible on this node")
        device = decide_device(requested, n_ranks=pipe.world_size, one_process=ranks_in_this_process(pipe),
                               gpus=on_node, data_parallel=pipe.data_parallel).device
    not_yet = None
    if device != "cpu":
        where = " under --launcher ray" if pipe.launcher == "ray" else " on GPUs"
        not_yet = (f"--device {requested}{where} (tensor parallelism runs on cpu over gloo so far): "
                   "use --device cpu")
    elif training and pipe.dp_shard == "fsdp" and pipe.data_parallel > 1 and cfg.d_model % pipe.data_parallel:
        not_yet = (f"--dp-shard fsdp with --data-parallel {pipe.data_parallel} not dividing d_model = "
                   f"{cfg.d_model} (FSDP2 shards the tp-split qkv weight's {cfg.d_model} columns "
                   "over the replicas, evenly): choose D dividing d_model, or --dp-shard replicate")
    if not_yet is not None:
        raise ValueError(f"--tensor-parallel {t} does not support {not_yet} yet")


def require_torchft() -> None:
    """ValueError (one `error:` line) when torchft, which `--fault-tolerance replicas` runs on, is missing."""
    # torchft's Rust side logs every quorum and commit at INFO, read when it is first imported; the
    # ranks inherit the setting.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError("--fault-tolerance replicas needs torchft: pip install 'attnres-pp[ft]'") from None
