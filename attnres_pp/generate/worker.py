"""GenerationWorker: one rank of a generation pipeline, hosted by a rank group (`launch.rank_group`)
in its own process (local launcher) or Ray actor, talking to its neighbours over torch.distributed
with the pipeline's DistTransport, or as a thread of the driver over the loopback transport
(in-process launcher, `join_threads`: the ranks take turns action by action). The hosting contract
is `launch.rank_host.RankHost`'s; this class supplies generation's parts (its transport, layers).

Like the training ranks, every rank builds the whole model from the seed, keeps its own chunks and
takes its parameters by whole-model name, so a checkpoint of any split loads into any other.
Under tensor parallelism (`tensor_parallel` T > 1, docs/spec.md section 10) global rank
`pp_rank * T + tp_rank` splits its chunks' layers over its stage's T ranks (`parallelize_layers`,
without sequence parallelism: a decode pass has one token, and the prefill runs unsharded too), so
each tp rank holds 1/T of the heads' key/value caches and every hop pair (p, t) -> (p + 1, t)
carries the whole activations; it takes its shard of each split weight from the whole-model value. The
driver exchanges only token ids and the last position's logits with the ranks, and decides each
rank's device: "cuda" is nccl with the rank's own GPU, "cpu" gloo. Under NCCL's point-to-point
rules (the nccl backend, or `p2p_semantics="nccl"` over gloo) the runtime issues its messages in
`lockstep_plan`'s batched groups (`BatchedDistTransport`); otherwise it preposts them (`DistTransport`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnres_pp.comm.nccl_transport import BatchedDistTransport
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import DistTransport
from attnres_pp.launch.rank_host import RankHost
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.precision import activation_dtype
from attnres_pp.pipeline.chunk import build_rank_chunks, rank_parameters
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.generation_runtime import GenerationRuntime
from attnres_pp.pipeline.mesh import MeshCollectives, RankCoords


def build_model(cfg: ModelConfig, named: dict[str, torch.Tensor] | None, seed: int = 0, *,
                precision: str = "fp32") -> Transformer:
    """The whole model from `seed`, then the values of `named` (by whole-model name) when given.
    `precision` "bf16" computes under bf16 autocast over the fp32 weights (`model.precision`)."""
    torch.manual_seed(seed)
    model = Transformer(cfg, precision=precision)
    if named is not None:
        load_parameters(dict(model.named_parameters()), named)
    return model.eval()


def load_parameters(params: dict[str, nn.Parameter], named: dict[str, torch.Tensor]) -> None:
    """Copy `named[name]` into every parameter of `params` (a tensor-parallel DTensor takes its own
    shard of it); ValueError if one is missing or misshapen."""
    missing = sorted(set(params) - set(named))
    if missing:
        raise ValueError(f"the checkpoint has no values for parameters {missing[:5]}: it was written for another model")
    with torch.no_grad():
        for name, param in params.items():
            if named[name].shape != param.shape:
                raise ValueError(f"checkpoint parameter {name} has shape {tuple(named[name].shape)}, the model "
                                 f"{tuple(param.shape)}: it was written for another model")
            _copy_whole(param, named[name])


def _copy_whole(param: nn.Parameter, whole: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        param.copy_(whole)
        return
    # src_data_rank None: every tp rank holds the same whole value and keeps its part, no collective
    shard = distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(shard.to_local())


def pipeline_partition(cfg: ModelConfig, pipe: PipelineConfig):
    """Generation's chunks: loop placement (its forward-only schedule is GPipe's forward order)."""
    return make_partition(cfg.n_layers, pipe.stages, pipe.virtual, pipe.layer_counts, placement="loop")


class GenerationWorker(RankHost):
    """One generation rank, hosted by a rank group through the `RankHost` contract."""

    def __init__(self, model_cfg_dict: dict, pipe_cfg_dict: dict, pp_rank: int, seed: int = 0,
                 threads: int = 1, *, tp_rank: int = 0, device: str = "cpu", precision: str = "fp32",
                 window: int | None = None) -> None:
        torch.set_num_threads(threads)
        self.cfg = ModelConfig.from_dict(model_cfg_dict)
        self.pipe = PipelineConfig.from_dict(pipe_cfg_dict)
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.coords = RankCoords(pp_rank * self.pipe.tensor_parallel + tp_rank, 1, self.pipe.stages,
                                 self.pipe.tensor_parallel)
        self.device_name, self.precision = device, precision
        self.window = window  # the key/value caches' attention window (None: the trained seq_len)
        self.model = build_model(self.cfg, None, seed, precision=precision)
        self.partition = pipeline_partition(self.cfg, self.pipe)
        self.chunks = build_rank_chunks(self.model, self.partition, pp_rank)
        self.params = rank_parameters(self.chunks, self.model)
        self.plan = plan_for_model(self.cfg, self.partition, cache=True)
        self.runtime: GenerationRuntime | None = None

    @property
    def rank(self) -> int:
        """The global rank: generation runs one replica, so `pp_rank * T + tp_rank`."""
        return self.coords.rank

    # ---- set-up: the RankHost contract's generation parts ----
    @property
    def device_choice(self) -> str:
        return self.device_name

    @property
    def timeout_s(self) -> float:
        return self.pipe.timeout_s

    def open_transport(self, device: torch.device, backend: str) -> tuple:
        """Batched groups under NCCL's rules (every rank resolves the same), else preposted p2p."""
        peers = [self.coords.global_rank(p) for p in range(self.pipe.stages)]
        if self.pipe.resolved_p2p(backend) == "nccl":
            return BatchedDistTransport(self.pp_rank, self.pipe.timeout_s, device, peer_ranks=peers), None
        return DistTransport(self.pp_rank, self.pipe.timeout_s, device, peer_ranks=peers), None

    def make_collectives(self, device: torch.device) -> MeshCollectives | None:
        """Generation needs no collectives of its own: only the ("dp", "pp", "tp") mesh whose tp axis
        splits the layers, under tensor parallelism."""
        return MeshCollectives(self.coords, device.type) if self.pipe.tensor_parallel > 1 else None

    def split_layers(self, tp_mesh) -> None:
        from attnres_pp.pipeline.tensor_parallel import parallelize_layers

        layers = [layer for chunk in self.chunks.values() for layer in chunk.layers.values()]
        parallelize_layers(self.cfg, layers, tp_mesh, sequence_parallel=False)
        self.params = rank_parameters(self.chunks, self.model)

    def attach(self, device: torch.device, transport, collectives=None, eval_transport=None) -> None:
        self.device = device
        self.model.to(device)
        self.runtime = GenerationRuntime(pp_rank=self.pp_rank, chunks=self.chunks, plan=self.plan, transport=transport,
                                         dtype=activation_dtype(self.precision), window=self.window)

    def held_params(self) -> int:
        from torch.distributed.tensor import DTensor

        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.params.values())

    def describe(self, backend: str) -> dict:
        return {**super().describe(backend), "tp_rank": self.tp_rank}

    def load_parameters(self, named: dict[str, torch.Tensor]) -> None:
        load_parameters(self.params, named)

    def reset(self) -> None:
        self.runtime.reset()

    def keep_rows(self, rows: list[int]) -> None:
        self.runtime.keep_rows(rows)

    def run_pass(self, batch_size: int, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor | None,
                 all_logits: bool = False) -> torch.Tensor | None:
        """One pass; `tokens_BT` (chunk 0's rank only) holds every piece's tokens side by side."""
        tokens_by_piece = None
        if tokens_BT is not None:
            tokens_by_piece = list(tokens_BT.to(self.device).split([n for _start, n in pieces], dim=1))
        if self.peers is None:
            logits = self.runtime.run_pass(batch_size, pieces, tokens_by_piece, all_logits)
        else:
            self.runtime.start_pass(batch_size, pieces, tokens_by_piece, all_logits)
            self.peers.run_together(self.rank, self.runtime, "generation pass")
            logits = self.runtime.finish_pass()
        return None if logits is None else logits.cpu()
