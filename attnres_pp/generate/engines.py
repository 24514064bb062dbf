"""Generators: the model behind the decode loop, in one process or pipelined (`make_generator`).

Every generator answers `forward(pieces, tokens_BT)` with the logits of the pass's last position,
keeping its key/value caches between calls until `reset()`:
- `SingleProcessGenerator`: the whole Transformer in this process (the ground truth);
- `InProcessGenerator`: every rank in this process over the loopback transport (debugging, tests);
- `ProcessGenerator` (`--launcher local`): one spawned process per rank, gloo between them;
- `RayGenerator` (`--launcher ray`, in `ray_generator`): one Ray actor per rank.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.generate.worker import build_model, pipeline_partition
from attnres_pp.model import DecodeState, ModelConfig
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.generation_runtime import GenerationRuntime, run_loopback_pass
from attnres_pp.pipeline.rank_processes import RankProcesses, serve


def _split(tokens_BT: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    return list(tokens_BT.split([n for _start, n in pieces], dim=1))


class SingleProcessGenerator:
    def __init__(self, cfg: ModelConfig, named: dict | None, seed: int = 0) -> None:
        self.cfg = cfg
        self.model = build_model(cfg, named, seed)
        self.reset()

    def reset(self) -> None:
        self.state = DecodeState(self.cfg)

    @torch.no_grad()
    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        outs = [self.model(idx_BT, decode=self.state.step(start, n))
                for (start, n), idx_BT in zip(pieces, _split(tokens_BT, pieces), strict=True)]
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]

    def close(self) -> None:
        """Nothing to release."""


class InProcessGenerator:
    """All ranks of the pipeline in this process; `ledger` counts what crossed between ranks."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0) -> None:
        self.cfg = cfg
        self.model = build_model(cfg, named, seed)
        partition = pipeline_partition(cfg, pipe)
        plan = plan_for_model(cfg, partition, cache=True)
        mailbox: dict = {}
        self.ledger = ByteLedger()
        self.runtimes = [
            GenerationRuntime(pp_rank=rank, chunks=build_rank_chunks(self.model, partition, rank), plan=plan,
                              transport=LoopbackTransport(rank, mailbox, self.ledger))
            for rank in range(pipe.stages)
        ]

    def reset(self) -> None:
        for runtime in self.runtimes:
            runtime.reset()

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        return run_loopback_pass(self.runtimes, tokens_BT.shape[0], pieces, _split(tokens_BT, pieces), all_logits)

    def close(self) -> None:
        """Nothing to release."""


def _serve(pp_rank: int, init_method: str, world_size: int, conn, model_cfg_dict: dict, pipe_cfg_dict: dict,
           seed: int, threads: int) -> None:
    """The rank process: build the worker, join the group, then answer requests."""
    from attnres_pp.generate.worker import GenerationWorker

    def make_worker():
        worker = GenerationWorker(model_cfg_dict, pipe_cfg_dict, pp_rank, seed, threads)
        return worker, worker.join_process_group(init_method, world_size)

    serve(make_worker, conn)


class ProcessGenerator:
    """`--launcher local`: one spawned process per rank; every wait is bounded by the pipeline timeout."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0,
                 threads: int = 1) -> None:
        self.cfg = cfg
        partition = pipeline_partition(cfg, pipe)  # a bad split fails here, before any process starts
        self.last_rank = partition.rank_of(partition.n_chunks - 1)
        extra = [(cfg.to_dict(), pipe.to_dict(), seed, threads)] * pipe.stages
        self._ranks = RankProcesses(_serve, pipe.stages, pipe.timeout_s, name="attnres-pp-generate", extra_args=extra)
        try:
            if named is not None:
                self._ranks.call("load_parameters", [(named,)] * pipe.stages)
        except BaseException:
            self.close()
            raise

    def reset(self) -> None:
        self._ranks.call_all("reset")

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        args = [(tokens_BT.shape[0], pieces, tokens_BT if rank == 0 else None, all_logits)
                for rank in range(len(self._ranks.procs))]
        return self._ranks.call("run_pass", args)[self.last_rank]

    def close(self) -> None:
        if self._ranks is not None:
            self._ranks.stop(graceful=True)
            self._ranks = None


def make_generator(cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, *, seed: int = 0, threads: int = 1,
                   address: str | None = None):
    """One process for a single chunk under the local launcher, else the launcher's pipeline."""
    if pipe.n_chunks == 1 and pipe.launcher == "local":
        return SingleProcessGenerator(cfg, named, seed)
    if pipe.launcher == "inprocess":
        return InProcessGenerator(cfg, pipe, named, seed)
    if pipe.launcher == "local":
        return ProcessGenerator(cfg, pipe, named, seed, threads)
    if pipe.launcher == "ray":
        from attnres_pp.generate.ray_generator import RayGenerator

        return RayGenerator(cfg, pipe, named, seed, threads, address=address)
    raise ValueError(f"launcher={pipe.launcher!r} is unknown: choose local, inprocess or ray")
