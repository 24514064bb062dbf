"""make_engine: the training Engine a RunConfig asks for. `--launcher local` with one chunk and one
replica trains in this process (`SingleProcessEngine`); a `--fault-tolerance replicas` run is an
`FtEngine` (one rank group per replica); every other run is a `PipelineEngine` on the launcher's
rank group: spawned processes (local), threads of this process (inprocess) or Ray actors (ray)."""

from __future__ import annotations

from attnres_pp.launch.launchers import make_rank_group
from attnres_pp.train.config import RunConfig
from attnres_pp.train.pipeline_engine import PipelineEngine
from attnres_pp.train.single_process_engine import SingleProcessEngine


def make_engine(run_cfg: RunConfig, out_dir=None, *, corpus=None, address: str | None = None,
                placement: str | None = None, fail_at: tuple[int, int] | None = None,
                record_timelines: bool = False):
    """`corpus` (the loaded `train.data`) serves the engines that read it in this process. `address`
    and `placement` are for the ray launcher; `fail_at` = (global rank, 0-based step) makes that
    rank's worker exit (ray and local launchers, with rank workers to lose); `record_timelines`
    makes every step return every rank's timeline."""
    pipe = run_cfg.pipeline
    check_tensor_parallel_runs(run_cfg)
    if address is not None and pipe.launcher != "ray":
        raise ValueError(f"--address is for --launcher ray, not {pipe.launcher}")
    if run_cfg.train.fault_tolerance == "replicas":  # each replica a torchft group (`train.ft_engine`)
        from attnres_pp.train.ft_engine import FtEngine

        return FtEngine(run_cfg, out_dir, address=address, placement=placement, fail_at=fail_at,
                        record_timelines=record_timelines)
    single = pipe.is_single_process and pipe.launcher == "local"
    if fail_at is not None and (single or pipe.launcher == "inprocess"):
        raise ValueError("--inject-failure needs rank workers to lose: use --launcher ray, or --launcher local "
                         "with --stages/--virtual > 1")
    if single:
        return SingleProcessEngine(run_cfg.model, run_cfg.train, corpus=corpus)
    return make_pipeline_engine(run_cfg, out_dir, corpus=corpus, address=address, placement=placement,
                                fail_at=fail_at, record_timelines=record_timelines)


def check_tensor_parallel_runs(run_cfg: RunConfig) -> None:
    """ValueError, before any rank starts, for a T > 1 run this driver cannot start: a tp group
    larger than this node's GPUs (a --device cuda run of the local launcher), and what the runtime
    does not run with tensor parallelism yet (each refusal names it). What runs: local rank
    processes, or Ray actors under any placement (each tp group one bundle, so on one node), over
    gloo on cpu, or in-process threads over the threaded process group
    (`launch.threaded_process_group`), fp32 or bf16, the torch kernels, every schedule (the split
    backward's included), cache on or off, D replicas of replicated parameters or of FSDP2 shards (D
    dividing d_model), every activation checkpointing policy, and every variant with or without
    sequence parallelism."""
    pipe, train, t = run_cfg.pipeline, run_cfg.train, run_cfg.pipeline.tensor_parallel
    if t == 1:
        return
    if train.device == "cuda" and pipe.launcher in ("local", "inprocess"):
        pipe.check_tensor_parallel_fits_node(_gpus(), "GPUs visible on this node")
    on_gpu = train.device == "cuda" or (train.device == "auto" and _gpus() >= pipe.world_size)
    not_yet = None
    if pipe.launcher == "ray" and train.device != "cpu":
        not_yet = (f"--device {train.device} under --launcher ray (tensor parallelism runs on cpu over gloo so "
                   "far, and auto could pick the cluster's GPUs): use --device cpu")
    elif on_gpu:
        not_yet = f"--device {train.device} on GPUs (tensor parallelism runs on cpu over gloo so far): use --device cpu"
    elif pipe.dp_shard == "fsdp" and pipe.data_parallel > 1 and run_cfg.model.d_model % pipe.data_parallel:
        not_yet = (f"--dp-shard fsdp with --data-parallel {pipe.data_parallel} not dividing d_model = "
                   f"{run_cfg.model.d_model} (FSDP2 shards the tp-split qkv weight's {run_cfg.model.d_model} columns "
                   "over the replicas, evenly): choose D dividing d_model, or --dp-shard replicate")
    if not_yet is not None:
        raise ValueError(f"--tensor-parallel {t} does not support {not_yet} yet")


def _gpus() -> int:
    from attnres_pp.train import devices

    return devices.visible_gpus()


def make_pipeline_engine(run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                         placement: str | None = None, **options) -> PipelineEngine:
    """A PipelineEngine on the launcher's rank group, even for one chunk (the benchmarks measure the
    ranks themselves); `options` as PipelineEngine's."""
    pipe = run_cfg.pipeline
    return PipelineEngine(run_cfg, out_dir, **options,
                          ranks=lambda: make_rank_group(pipe, pipe.world_size, name="attnres-pp", address=address,
                                                        placement=placement))
