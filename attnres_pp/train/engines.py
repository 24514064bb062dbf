"""make_engine: the training Engine a RunConfig asks for. `--launcher local` with one chunk and one
replica trains in this process (`SingleProcessEngine`); every other run is a `PipelineEngine` on
the launcher's rank group: spawned processes (local), threads of this process (inprocess) or Ray
actors (ray)."""

from __future__ import annotations

from attnres_pp.pipeline.rank_group import make_rank_group
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
    larger than this node's GPUs (a --device cuda run of the local launcher), and, until the
    pipeline runtime places chunks on a (dp, pp, tp) mesh, every T > 1 run. The layer split itself
    (`pipeline.tensor_parallel`) runs and is tested on its own."""
    pipe = run_cfg.pipeline
    if pipe.tensor_parallel == 1:
        return
    if run_cfg.train.device == "cuda" and pipe.launcher in ("local", "inprocess"):
        from attnres_pp.train.devices import visible_gpus

        pipe.check_tensor_parallel_fits_node(visible_gpus(), "GPUs visible on this node")
    raise ValueError(f"--tensor-parallel {pipe.tensor_parallel} is not supported yet by `attnres-pp train`: the "
                     "pipeline runtime builds each chunk on one rank (its stage workers, executor, hops and "
                     "checkpoints have no tp axis); train with --tensor-parallel 1")


def make_pipeline_engine(run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                         placement: str | None = None, **options) -> PipelineEngine:
    """A PipelineEngine on the launcher's rank group, even for one chunk (the benchmarks measure the
    ranks themselves); `options` as PipelineEngine's."""
    pipe = run_cfg.pipeline
    return PipelineEngine(run_cfg, out_dir, **options,
                          ranks=lambda: make_rank_group(pipe, pipe.world_size, name="attnres-pp", address=address,
                                                        placement=placement))
