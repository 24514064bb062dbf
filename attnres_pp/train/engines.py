"""make_engine: the training engine a RunConfig asks for, always the one `Engine` (`train.engine`)
under a replica policy: D torchft replica groups for `--fault-tolerance replicas`
(`train.ft_replicas`), else one group (`train.replica_policy.OneGroup`). `--launcher local` with one
chunk and one replica (the one-process run) is that group with one rank, in this process
(`launch.thread_rank_group`: the lone rank runs on the caller's thread); every other run's group
is the launcher's: spawned processes (local), threads of this process (inprocess), Ray actors (ray)
or the processes torchrun started, rank 0 driving (torchrun), which only torchrun can start again."""

from __future__ import annotations

from attnres_pp.launch.launchers import make_rank_group
from attnres_pp.launch.resolve import (
    check_tensor_parallel,
    decide_kernels,
    engine_of,
    ranks_in_this_process,
    require_torchft,
)
from attnres_pp.train.config import RunConfig
from attnres_pp.train.engine import Engine
from attnres_pp.train.replica_policy import OneGroup


def make_engine(run_cfg: RunConfig, out_dir=None, *, corpus=None, address: str | None = None,
                placement: str | None = None, fail_at: tuple[int, int] | None = None,
                record_timelines: bool = False, rehearse: bool = True):
    """`corpus` (the loaded `train.data`) serves the engines that read it in this process. `address`
    and `placement` are for the ray launcher; `fail_at` = (global rank, 0-based step) makes that
    rank's worker exit (ray and local launchers, with rank workers to lose); `record_timelines`
    makes every step return every rank's timeline; `rehearse`: the ranks' env rehearsal hooks
    (`train.faults`) may act (not when the ranks start again after one was lost at start-up)."""
    pipe = run_cfg.pipeline
    check_run(run_cfg, address=address, fail_at=fail_at)
    engine = engine_of(pipe, run_cfg.train.fault_tolerance)
    if engine == "replicas":  # each replica a torchft group (`train.ft_replicas`)
        from attnres_pp.train.ft_replicas import FtReplicaGroups

        return Engine(run_cfg, out_dir, policy=FtReplicaGroups(address=address, placement=placement),
                      fail_at=fail_at, record_timelines=record_timelines)
    if engine == "single":
        from attnres_pp.launch.thread_rank_group import ThreadRankGroup

        return Engine(run_cfg, out_dir, policy=OneGroup(lambda: ThreadRankGroup(1, stages=1, timeout_s=pipe.timeout_s)),
                      corpus=corpus, record_timelines=record_timelines, rehearse=rehearse)
    return make_pipeline_engine(run_cfg, out_dir, corpus=corpus, address=address, placement=placement,
                                fail_at=fail_at, record_timelines=record_timelines, rehearse=rehearse)


def check_run(run_cfg: RunConfig, *, address: str | None = None, fail_at: tuple | None = None) -> None:
    """ValueError, before anything starts, for a combination of the run's flags that cannot run: the
    refusals that depend on the machine (`launch.resolve`) and on the one-off flags."""
    pipe, train = run_cfg.pipeline, run_cfg.train
    check_tensor_parallel(run_cfg.model, pipe, train.device)
    if train.device == "cpu":  # Triton on cpu outside the interpreter: refused before Ray or a rank starts
        decide_kernels(train.kernels, "cpu")
    if train.fault_tolerance == "replicas":
        require_torchft()
    if address is not None and pipe.launcher != "ray":
        raise ValueError(f"--address is for --launcher ray, not {pipe.launcher}")
    if pipe.launcher == "torchrun":  # every process a rank, rank 0 drives (`launch.torchrun_rank_group`)
        from attnres_pp.launch.torchrun_rank_group import check_torchrun_run

        check_torchrun_run(pipe, fault_tolerance=train.fault_tolerance)
    if fail_at is not None and ranks_in_this_process(pipe):
        raise ValueError("--inject-failure needs rank workers to lose: use --launcher ray, or --launcher local "
                         "with --stages/--virtual > 1")


def make_pipeline_engine(run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                         placement: str | None = None, **options) -> Engine:
    """The engine on one group of the launcher's ranks, even for one chunk (the benchmarks measure the
    ranks themselves); `options` as Engine's. torchrun's ranks are not restartable: only torchrun
    can start them again (`torchrun --max-restarts`)."""
    pipe = run_cfg.pipeline
    policy = OneGroup(lambda: make_rank_group(pipe, pipe.world_size, name="attnres-pp", address=address,
                                              placement=placement),
                      restartable=pipe.launcher != "torchrun")
    return Engine(run_cfg, out_dir, policy=policy, **options)
