"""Generators: the model behind the decode loop, in one process or pipelined (`make_generator`).

Every generator answers `forward(pieces, tokens_BT)` with the logits of the pass's last position
`[B, V]` (on the CPU), for a batch of B sequences at the same positions, keeping its key/value
caches between calls until `reset()`; `keep_rows(rows)` drops the other sequences from them:
- `SingleProcessGenerator`: the whole Transformer in this process (the ground truth; `--launcher
  local` with one chunk);
- `PipelineGenerator`: one `GenerationWorker` per rank on the launcher's rank group
  (`launch.rank_group`): spawned processes (local), Ray actors (ray), or threads of this process
  over the loopback transport (inprocess: debugging, tests), under gloo's rules or, with
  `p2p_semantics="nccl"`, NCCL's, enforced (`pipeline.loopback_nccl`). With `tensor_parallel` T > 1
  there are P x T ranks, each stage's layers split over its T ranks (`generate.worker`); what that
  runs on is `check_tensor_parallel_generation`'s to say.

`window` is the key/value caches' attention window (None: the trained seq_len; `model.decode_state`):
a rotary-position model decodes past its trained length with caches of that many positions.
`device` is "cpu" or "cuda", decided by the launch layer (`decide_generation`, `launch.resolve`);
`precision` "fp32" or "bf16" (bf16 autocast over the checkpoint's fp32 weights, as training
computes, with bf16 hops).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnres_pp.comm.transport import ByteLedger
from attnres_pp.generate.worker import GenerationWorker, build_model, pipeline_partition
from attnres_pp.launch.launchers import make_rank_group
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.resolve import check_tensor_parallel, resolve_run, single_process, visible_gpus
from attnres_pp.model import DecodeState, ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.mesh import RankCoords


def decide_generation(requested_device: str, dtype: str, pipe: PipelineConfig, gpus: int | None = None):
    """The launch layer's `ResolvedRun` of a generation on `pipe` (`launch.resolve`): the device for
    `--device requested_device` against `gpus` (this node's by default; the Ray cluster's once
    joined), and the precision for `--dtype`; ValueError with the reason when cuda is asked for
    and the ranks cannot each have a GPU."""
    return resolve_run(pipe, device=requested_device, dtype=dtype, kernels="auto",
                       gpus=visible_gpus() if gpus is None else gpus)


def check_tensor_parallel_generation(cfg: ModelConfig, pipe: PipelineConfig, requested: str,
                                     gpus: int | None = None) -> None:
    """ValueError, before any rank starts, for a T > 1 generation that cannot run
    (`launch.resolve.check_tensor_parallel`, without training's rules)."""
    check_tensor_parallel(cfg, pipe, requested, gpus=gpus, whose="the checkpoint's ", training=False)


def _split(tokens_BT: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    return list(tokens_BT.split([n for _start, n in pieces], dim=1))


class SingleProcessGenerator:
    def __init__(self, cfg: ModelConfig, named: dict | None, seed: int = 0, *, device: str = "cpu",
                 precision: str = "fp32", window: int | None = None) -> None:
        self.cfg = cfg
        self.window = window
        self.device = torch.device(device)
        self.model = build_model(cfg, named, seed, precision=precision).to(self.device)
        self.reset()

    def reset(self) -> None:
        self.state = DecodeState(self.cfg, window=self.window)

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


class PipelineGenerator:
    """Every rank of the pipeline on a rank group, made by `ranks()` once the split is checked; every
    wait is bounded by the pipeline timeout. The device is decided again against the GPUs the
    group can give (the Ray cluster's: "auto" resolves there) and `precision` "auto" with it.
    `ledger` counts what crossed between in-process ranks (None for the others)."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0,
                 threads: int = 1, *, ranks: Callable[[], RankGroup], device: str = "cpu",
                 precision: str = "fp32", ledger: ByteLedger | None = None, window: int | None = None) -> None:
        self.cfg = cfg
        self.window = window
        partition = pipeline_partition(cfg, pipe)  # a bad split fails here, before any rank starts
        self.coords = [RankCoords(rank, 1, pipe.stages, pipe.tensor_parallel)
                       for rank in range(pipe.stages * pipe.tensor_parallel)]
        # the last chunk's logits, from its stage's tp rank 0 (every tp rank holds the same)
        self.last_rank = self.coords[0].global_rank(partition.rank_of(partition.n_chunks - 1))
        self.first_pp_rank = partition.rank_of(0)
        check_tensor_parallel_generation(cfg, pipe, device)
        self.ranks: RankGroup | None = None
        self.ledger = ledger
        try:
            self.ranks = ranks()
            # "auto" may find GPUs in a Ray cluster, where tensor parallelism does not run yet
            check_tensor_parallel_generation(cfg, pipe, device, self.ranks.gpus())
            resolved = decide_generation(device, precision, pipe, gpus=self.ranks.gpus())
            self.device, self.precision = resolved.device, resolved.dtype
            kwargs = [{"model_cfg_dict": cfg.to_dict(), "pipe_cfg_dict": pipe.to_dict(), "pp_rank": coords.pp_rank,
                       "tp_rank": coords.tp_rank, "seed": seed, "threads": threads, "device": self.device,
                       "precision": self.precision, "window": window} for coords in self.coords]
            self.ranks.start(GenerationWorker, kwargs, device=self.device)
            if named is not None:
                self.ranks.call_all("load_parameters", named, what="parameter load")
        except BaseException:
            self.close()
            raise

    def reset(self) -> None:
        self.ranks.call_all("reset", what="reset")

    def keep_rows(self, rows: list[int]) -> None:
        self.ranks.call_all("keep_rows", rows, what="dropping finished sequences")

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        args = [(tokens_BT.shape[0], pieces, tokens_BT if coords.pp_rank == self.first_pp_rank else None, all_logits)
                for coords in self.coords]
        return self.ranks.call("run_pass", args, what="a generation pass")[self.last_rank]

    def close(self) -> None:
        """Stop the ranks (and a Ray instance the group started); safe to call twice."""
        if self.ranks is not None:
            self.ranks.stop(graceful=True)
            self.ranks = None


def make_generator(cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, *, seed: int = 0, threads: int = 1,
                   address: str | None = None, device: str = "cpu", precision: str = "fp32",
                   window: int | None = None):
    """One process for a single chunk under the local launcher, else a `PipelineGenerator` on the
    launcher's rank group. `device` is decided (`decide_generation`), except under Ray, which
    decides "auto" and checks "cuda" against the cluster's GPUs; `precision` is "fp32", "bf16" or
    (Ray) "auto"; `window` the caches' attention window (None: the trained seq_len)."""
    if single_process(pipe):
        return SingleProcessGenerator(cfg, named, seed, device=device, precision=precision, window=window)
    ledger = ByteLedger() if pipe.launcher == "inprocess" else None
    return PipelineGenerator(cfg, pipe, named, seed, threads, device=device, precision=precision, ledger=ledger,
                             window=window,
                             ranks=lambda: make_rank_group(pipe, pipe.stages * pipe.tensor_parallel,
                                                           name="attnres-pp-generate",
                                                           address=address, ledger=ledger))
