"""Generators: the model behind the decode loop, in one process or pipelined (`make_generator`).

Every generator answers `forward(pieces, tokens_BT)` with the logits of the pass's last position
`[B, V]` (on the CPU), for a batch of B sequences at the same positions, keeping its key/value
caches between calls until `reset()`; `keep_rows(rows)` drops the other sequences from them:
- `SingleProcessGenerator`: the whole Transformer in this process (the ground truth);
- `InProcessGenerator`: every rank in this process over the loopback transport (debugging, tests),
  under gloo's rules or, with `p2p_semantics="nccl"`, NCCL's, enforced (`pipeline.loopback_nccl`);
- `ProcessGenerator` (`--launcher local`): one spawned process per rank, gloo or nccl between them;
- `RayGenerator` (`--launcher ray`, in `ray_generator`): one Ray actor per rank.

`device` is "cpu" or "cuda", decided by the driver (`decide_generation_device`, the rules of
`train.devices`); `precision` "fp32" or "bf16" (bf16 autocast over the checkpoint's fp32 weights, as
training computes, with bf16 hops).
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.generate.worker import build_model, pipeline_partition
from attnres_pp.model import DecodeState, ModelConfig
from attnres_pp.model.precision import activation_dtype
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.generation_runtime import GenerationRuntime, run_loopback_pass
from attnres_pp.pipeline.rank_processes import RankProcesses, serve
from attnres_pp.train.devices import decide_device, visible_gpus


def decide_generation_device(requested: str, pipe: PipelineConfig, gpus: int | None = None) -> str:
    """"cpu" or "cuda" for `--device requested` ("auto", "cpu", "cuda"); ValueError with the reason
    when cuda is asked for and the ranks cannot each have a GPU. `gpus` defaults to this node's;
    the Ray launcher decides with the cluster's instead (`RayGenerator`)."""
    one_process = pipe.launcher == "inprocess" or (pipe.launcher == "local" and pipe.n_chunks == 1)
    return decide_device(requested, n_ranks=pipe.stages, one_process=one_process,
                         gpus=visible_gpus() if gpus is None else gpus).device


def resolve_precision(dtype: str, device: str) -> str:
    """`--dtype` for the device: auto is bf16 on cuda and fp32 on cpu, as in training."""
    return ("bf16" if device == "cuda" else "fp32") if dtype == "auto" else dtype


def _split(tokens_BT: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    return list(tokens_BT.split([n for _start, n in pieces], dim=1))


class SingleProcessGenerator:
    def __init__(self, cfg: ModelConfig, named: dict | None, seed: int = 0, *, device: str = "cpu",
                 precision: str = "fp32") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = build_model(cfg, named, seed, precision=precision).to(self.device)
        self.reset()

    def reset(self) -> None:
        self.state = DecodeState(self.cfg)

    def keep_rows(self, rows: list[int]) -> None:
        self.state.keep_rows(rows)

    @torch.no_grad()
    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        tokens_BT = tokens_BT.to(self.device)
        outs = [self.model(idx_BT, decode=self.state.step(start, n))
                for (start, n), idx_BT in zip(pieces, _split(tokens_BT, pieces), strict=True)]
        return (torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]).cpu()

    def close(self) -> None:
        """Nothing to release."""


class InProcessGenerator:
    """All ranks of the pipeline in this process; `ledger` counts what crossed between ranks."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0, *,
                 device: str = "cpu", precision: str = "fp32") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = build_model(cfg, named, seed, precision=precision).to(self.device)
        partition = pipeline_partition(cfg, pipe)
        plan = plan_for_model(cfg, partition, cache=True)
        self.ledger = ByteLedger()
        self.p2p_semantics = pipe.resolved_p2p("loopback")
        if self.p2p_semantics == "nccl":
            from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
            from attnres_pp.schedule.validate_nccl import NcclP2P

            fabric = NcclP2P(pipe.stages)
            transports = [NcclLoopbackTransport(rank, fabric, self.ledger) for rank in range(pipe.stages)]
        else:
            mailbox: dict = {}
            transports = [LoopbackTransport(rank, mailbox, self.ledger) for rank in range(pipe.stages)]
        self.runtimes = [
            GenerationRuntime(pp_rank=rank, chunks=build_rank_chunks(self.model, partition, rank), plan=plan,
                              transport=transports[rank], dtype=activation_dtype(precision))
            for rank in range(pipe.stages)
        ]

    def reset(self) -> None:
        for runtime in self.runtimes:
            runtime.reset()

    def keep_rows(self, rows: list[int]) -> None:
        for runtime in self.runtimes:
            runtime.keep_rows(rows)

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        tokens_BT = tokens_BT.to(self.device)
        return run_loopback_pass(self.runtimes, tokens_BT.shape[0], pieces, _split(tokens_BT, pieces),
                                 all_logits).cpu()

    def close(self) -> None:
        """Nothing to release."""


def _serve(pp_rank: int, init_method: str, world_size: int, conn, model_cfg_dict: dict, pipe_cfg_dict: dict,
           seed: int, threads: int, device: str, precision: str) -> None:
    """The rank process: build the worker, join the group, then answer requests."""
    from attnres_pp.generate.worker import GenerationWorker

    def make_worker():
        worker = GenerationWorker(model_cfg_dict, pipe_cfg_dict, pp_rank, seed, threads, device=device,
                                  precision=precision)
        return worker, worker.join_process_group(init_method, world_size)

    serve(make_worker, conn)


class ProcessGenerator:
    """`--launcher local`: one spawned process per rank; every wait is bounded by the pipeline timeout."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0,
                 threads: int = 1, *, device: str = "cpu", precision: str = "fp32") -> None:
        self.cfg = cfg
        partition = pipeline_partition(cfg, pipe)  # a bad split fails here, before any process starts
        self.last_rank = partition.rank_of(partition.n_chunks - 1)
        extra = [(cfg.to_dict(), pipe.to_dict(), seed, threads, device, precision)] * pipe.stages
        self._ranks = RankProcesses(_serve, pipe.stages, pipe.timeout_s, name="attnres-pp-generate", extra_args=extra)
        try:
            if named is not None:
                self._ranks.call("load_parameters", [(named,)] * pipe.stages)
        except BaseException:
            self.close()
            raise

    def reset(self) -> None:
        self._ranks.call_all("reset")

    def keep_rows(self, rows: list[int]) -> None:
        self._ranks.call("keep_rows", [(rows,)] * len(self._ranks.procs))

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        args = [(tokens_BT.shape[0], pieces, tokens_BT if rank == 0 else None, all_logits)
                for rank in range(len(self._ranks.procs))]
        return self._ranks.call("run_pass", args)[self.last_rank]

    def close(self) -> None:
        if self._ranks is not None:
            self._ranks.stop(graceful=True)
            self._ranks = None


def make_generator(cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, *, seed: int = 0, threads: int = 1,
                   address: str | None = None, device: str = "cpu", precision: str = "fp32"):
    """One process for a single chunk under the local launcher, else the launcher's pipeline.
    `device` is decided (`decide_generation_device`), except under Ray, which decides "auto" and
    checks "cuda" against the cluster's GPUs; `precision` is "fp32", "bf16" or (Ray) "auto"."""
    if pipe.launcher == "ray":
        from attnres_pp.generate.ray_generator import RayGenerator

        return RayGenerator(cfg, pipe, named, seed, threads, address=address, device=device, dtype=precision)
    options = {"device": device, "precision": precision}
    if pipe.n_chunks == 1 and pipe.launcher == "local":
        return SingleProcessGenerator(cfg, named, seed, **options)
    if pipe.launcher == "inprocess":
        return InProcessGenerator(cfg, pipe, named, seed, **options)
    if pipe.launcher == "local":
        return ProcessGenerator(cfg, pipe, named, seed, threads, **options)
    raise ValueError(f"launcher={pipe.launcher!r} is unknown: choose local, inprocess or ray")
