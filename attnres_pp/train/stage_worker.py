"""StageWorker: one rank of a data-parallel x pipeline-parallel run (docs/spec.md section 6), with its chunks,
optimizer, data and runtimes. A rank group (`launch.rank_group`) hosts one per rank through the
`launch.rank_host.RankHost` contract: in a spawned process or a Ray actor, joined to a process group
(`join_process_group`), or as a thread of the driver's process over the loopback transport
(`join_threads`); this class supplies the training parts (its transport, mesh, runtimes). It lives in
the training layer because it owns the optimiser step and the checkpoint state; the pipeline below
it provides the chunks, the schedules, the runtime, the transports and the mesh.

Global rank `rank = (dp_rank * P + pp_rank) * T + tp_rank` (`pipeline.mesh`; T = 1 without tp, `train.tp_rank`).
A rank builds only its own chunks (the rest stays on the meta device), initialised by whole-model name and
the run's seed: its weights equal the single process's. It reads its own microbatches by (step, dp_rank)
(`rank_data`), averages its gradients over its replicas (`grad_sync`; MSAR's stream convolutions, on every
rank, and a tied embedding's copies on the first and last rank, `grad_sync.TiedEmbedding`, are reduced
between their holders and counted once in the norm) and answers the driver with scalars (`StepReply`).

Device, dtype and kernels come resolved from the driver (`launch.resolve`): a rank never decides
them. On "cuda" it joins the nccl group on its own GPU, computes in the run's precision (bf16
autocast with fp32 master weights; hops, cache entries and deposits in bf16), times its actions
with CUDA events and steps a fused AdamW. Under NCCL's point-to-point rules (the nccl backend, or
`p2p_semantics="nccl"`) its messages go out in `validate_nccl.lockstep_plan`'s batched groups.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from attnres_pp.comm.nccl_transport import BatchedDistTransport
from attnres_pp.comm.pair_transport import PairTransport, connect_pair_transport
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.shm_transport import SharedMemoryTransport
from attnres_pp.comm.transport import DistTransport
from attnres_pp.data import Corpus
from attnres_pp.launch.rank_host import RankHost
from attnres_pp.model.precision import activation_dtype
from attnres_pp.model.routing import RoutingProbe, set_probe
from attnres_pp.pipeline.chunk import build_rank_model, rank_module_names, rank_parameters
from attnres_pp.pipeline.expert_parallel import connect_experts, expert_rows
from attnres_pp.pipeline.mesh import Collectives, MeshCollectives, RankCoords
from attnres_pp.pipeline.routes import hop_shapes, wire_messages
from attnres_pp.pipeline.runtime import StageRuntime, StepRecord
from attnres_pp.pipeline.stage_setup import lowered_schedule, run_partition
from attnres_pp.schedule.forward_schedule import forward_only_schedule
from attnres_pp.schedule.validate_nccl import check_nccl
from attnres_pp.train.background_save import ONE_PROCESS_TIMEOUT_S, BackgroundSave
from attnres_pp.train.config import RunConfig, resolve_training
from attnres_pp.train.expert_balance import ExpertBalance
from attnres_pp.train.faults import (
    lose_this_rank,
    rehearse_freeze,
    rehearse_slow_step,
    rehearse_start_loss,
    slow_step_s,
)
from attnres_pp.train.grad_norm import norm_groups, norm_reducer
from attnres_pp.train.grad_sync import TiedEmbedding, ensure_grads, sync_expert_gradients, sync_gradients
from attnres_pp.train.memory_report import grad_bytes, memory_entry, peak_rss_bytes, transport_buffer_bytes
from attnres_pp.train.optim import build_optimizer, optimizer_step
from attnres_pp.train.rank_data import MicrobatchLists, RankData
from attnres_pp.train.shard_saves import ShardSaves
from attnres_pp.train.shards import rng_stream
from attnres_pp.train.step_stats import StepReply
from attnres_pp.train.tp_rank import RankTensorParallel, held_over_tp, is_split

# A driver-fed batch for one rank: its replica's rows of (inputs, targets), either half None when
# the rank does not need it. Only tests and benchmarks feed batches; training runs read their own.
RankBatch = tuple[torch.Tensor | None, torch.Tensor | None]


class StageWorker(ExpertBalance, ShardSaves, RankHost):
    """One training rank, hosted by a rank group through the `RankHost` contract."""

    def __init__(self, run_cfg_dict: dict, rank: int, *, corpus: Corpus | None = None, data_path: str | None = None,
                 fail_at_step: int | None = None, rehearse: bool = False) -> None:
        run_cfg = RunConfig.from_dict(run_cfg_dict)
        if run_cfg.train.device == "auto":  # not from a driver (tests): cpu, as gloo needs
            run_cfg, _ = resolve_training(run_cfg, gpus=0)
        self.run_cfg = run_cfg
        cfg, train, pipe = self.run_cfg.model, self.run_cfg.train, self.run_cfg.pipeline
        self.coords = RankCoords(rank, pipe.data_parallel, pipe.stages, pipe.tensor_parallel, pipe.expert_parallel)
        self.rank, self.pp_rank, self.dp_rank = rank, self.coords.pp_rank, self.coords.dp_rank
        self.tp = RankTensorParallel(cfg, pipe, self.coords.tp_rank)
        self.tp_bytes: int | None = None  # what this rank's tp collectives send per step, once counted
        torch.set_num_threads(train.threads)
        self.partition = run_partition(cfg.n_layers, pipe)
        self.tied_emb = TiedEmbedding(cfg.tie_embeddings, self.partition, self.pp_rank)
        self.model, self.chunks = build_rank_model(cfg, self.partition, self.pp_rank, seed=train.seed,
                                                   backend=train.kernels, precision=train.dtype,
                                                   activation_checkpoint=train.activation_checkpoint,
                                                   expert_parallel=(self.coords.ep_rank, pipe.expert_parallel),
                                                   compile=train.compile)
        self.owned_modules = rank_module_names(cfg, self.partition, self.pp_rank)
        self._build_params(fused=False)
        self.plan = plan_for_model(cfg, self.partition, pipe.cache)
        self.schedule = lowered_schedule(pipe, train.microbatches)
        self.eval_schedule = forward_only_schedule(pipe.stages, pipe.virtual, self.run_cfg.eval_microbatches,
                                                   self.partition.placement)
        if pipe.p2p_semantics != "gloo":  # the runtime may issue it under NCCL's rules: prove it finishes
            check_nccl(self.eval_schedule)
        self.data = RankData(self.run_cfg, self.dp_rank, corpus=corpus, data_path=data_path,
                             needs_inputs=self.partition.rank_of(0) == self.pp_rank,
                             needs_targets=self.partition.rank_of(pipe.n_chunks - 1) == self.pp_rank)
        self.fail_at_step = fail_at_step  # rehearsal of a lost rank: exit mid-step at this step
        self.rehearse = rehearse  # the ranks' first start: the env hooks of `train.faults` may act
        self.slow_step_s = slow_step_s()  # ATTNRES_PP_SLOW_STEP_S: a sleep before each step, on every start
        self.runtime: StageRuntime | None = None
        self._grad_bytes = 0  # gradients held after the last sync (`memory`)
        self.fsdp = None  # FSDP2 units under dp_shard="fsdp" with D > 1 (`train.fsdp`)
        self.eval_runtime: StageRuntime | None = None
        self.collectives: Collectives | None = None
        self.background_save: BackgroundSave | None = None  # --async-checkpoint's write in flight

    def _build_params(self, *, fused: bool) -> None:
        """This rank's parameters by whole-model name, split into those tied across ranks (MSAR's stream convolutions,
        reduced over every rank) and the rest, and the optimizer over them (`fused`: the fused AdamW of parameters
        on a GPU). Built again whenever they become other tensors: tp DTensors, FSDP2 shards, or a move to the GPU."""
        self.params = rank_parameters(self.chunks, self.model)
        self.tied = [p for name, p in self.params.items() if name.startswith("stream_convs.")]
        # Expert parallelism's slices of the routed experts: summed over their holders (`grad_sync`).
        rows = expert_rows(self.model)
        self.experts = [p for name, p in self.params.items() if name in rows]
        # MoE's selection bias is a parameter for the checkpoints, without gradient (`model.moe`).
        self.untied = [p for name, p in self.params.items()
                       if not name.startswith("stream_convs.") and p.requires_grad and name not in rows]
        self.optimizer = build_optimizer(self.params.items(), self.run_cfg.train, fused=fused,
                                         router_lr_scale=self.run_cfg.model.moe_router_lr_scale)

    # ---- set-up: the RankHost contract's training parts ----
    @property
    def device_choice(self) -> str:
        return self.run_cfg.train.device

    @property
    def timeout_s(self) -> float:
        pipe = self.run_cfg.pipeline
        # A lone rank has no peer to wait for: only the filesystem can stall it (a background checkpoint write).
        return max(pipe.timeout_s, ONE_PROCESS_TIMEOUT_S) if pipe.world_size == 1 else pipe.timeout_s

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        if self.rehearse:  # ATTNRES_PP_LOSE_RANK_AT_START: this process ends as its peers join
            rehearse_start_loss(self.rank)
        return super().join_process_group(init_method, world_size)

    def connect(self, device: torch.device, backend: str = "gloo") -> None:
        """`RankHost.connect`, then under dp_shard="fsdp" with D > 1 the FSDP2 units over the replicas."""
        super().connect(device, backend)
        pipe = self.run_cfg.pipeline
        if pipe.dp_shard == "fsdp" and pipe.data_parallel > 1:
            self._shard(self.collectives.mesh["dp"])

    def open_transport(self, device: torch.device, backend: str) -> tuple:
        """Collective: the ranks agree on the transport. Under NCCL's rules (the nccl backend, or
        p2p_semantics="nccl") the p2p messages go out in batched groups (`BatchedDistTransport`);
        otherwise per peer (`comm.pair_transport`): shared memory to a peer on this rank's node
        (`node_id`, else the host name) when no link is emulated, gloo p2p to the others."""
        pipe, cfg, train = self.run_cfg.pipeline, self.run_cfg.model, self.run_cfg.train
        peers = self.pipeline_peers()
        hop_dtype = activation_dtype(train.dtype, self.dtype)
        if pipe.resolved_p2p(backend) == "nccl":  # every rank resolves the same: none takes the collective
            transport = BatchedDistTransport(self.pp_rank, pipe.timeout_s, device, peer_ranks=peers, link=pipe.link)
        else:
            shape_of = hop_shapes((self.run_cfg.microbatch_size, self.tp.seq_len), cfg.source_width, cfg.d_model)
            transport = connect_pair_transport(self.pp_rank, pipe.stages, device, pipe.timeout_s,
                                               wire_messages(self.schedule, self.plan, shape_of), hop_dtype,
                                               node=self.node_id or socket.gethostname(), peer_ranks=peers,
                                               link=pipe.link)
        if isinstance(transport, PairTransport) and isinstance(transport.inner, SharedMemoryTransport):
            # Evaluation's passes run back to back with no all-reduce between them, so a sender could
            # write a slot again before its receiver has read it: they go over plain p2p (same ledger).
            return transport, DistTransport(self.pp_rank, pipe.timeout_s, device, ledger=transport.ledger,
                                            peer_ranks=peers)
        return transport, None

    def pipeline_peers(self) -> list[int]:
        """The process-group ranks of this replica's P pipeline ranks, in pp order."""
        return [self.coords.global_rank(p) for p in range(self.run_cfg.pipeline.stages)]

    def make_collectives(self, device: torch.device) -> Collectives:
        """The collectives over the joined process group: the whole ("dp", "pp") mesh."""
        return MeshCollectives(self.coords, device.type, self.timeout_s, embedding_group=self.tied_emb.across_ranks)

    def split_layers(self, tp_mesh) -> None:
        """Tensor parallelism (`train.tp_rank`): the chunks' layers split over the tp ranks, so the
        parameter list and the optimizer are built again over the DTensor weights."""
        self.tp.split(self.chunks, self.model.stream_convs, tp_mesh)
        self.tp_group = tp_mesh.get_group()
        self._build_params(fused=self.device.type == "cuda")

    def _shard(self, dp_mesh) -> None:
        """FSDP2 units over the replicas (`train.fsdp`): the parameters become shards, so the parameter
        list and the optimizer are built again and the runtimes unshard chunks around their actions."""
        from attnres_pp.train.fsdp import FsdpShards

        pipe = self.run_cfg.pipeline
        expert_mesh = getattr(self.collectives, "expert_mesh", None)  # EP > 1: slices sharded over "edp"
        self.fsdp = FsdpShards(self.model, self.chunks, self.owned_modules, dp_mesh,
                               pipe.fsdp_reshard_after_forward or "never", self.run_cfg.train.dtype,
                               edp_mesh=None if expert_mesh is None else expert_mesh["edp"],
                               data_parallel=pipe.data_parallel)
        self._build_params(fused=self.device.type == "cuda")
        self.runtime.compute_hooks = self.fsdp
        self.eval_runtime.compute_hooks = self.fsdp

    def held_params(self) -> int:
        return sum(map(held_over_tp, self.params.values()))

    def describe(self, backend: str) -> dict:
        return {**super().describe(backend), "peak_rss_bytes": peak_rss_bytes()}

    def attach(self, device: torch.device, transport, collectives: Collectives, eval_transport=None) -> None:
        """Move to `device` and build the training and evaluation runtimes over `transport` (the
        evaluation's over `eval_transport` if given; a transport with `p2p_semantics = "nccl"` makes
        them issue messages in NCCL's order). Hops carry the run's activation dtype (bf16 under bf16)."""
        self.device, self.collectives = device, collectives
        connect_experts(self.model, collectives)
        for name in self.owned_modules:  # the rest of the model is on the meta device and stays there
            self.model.get_submodule(name).to(device)
        cfg, train = self.run_cfg.model, self.run_cfg.train
        if device.type == "cuda":  # fused AdamW needs the parameters on the GPU; no state exists yet
            self._build_params(fused=True)
        hop_dtype = activation_dtype(train.dtype, next(iter(self.params.values())).dtype)

        def runtime(schedule, transport) -> StageRuntime:
            return StageRuntime(pp_rank=self.pp_rank, chunks=self.chunks, plan=self.plan, schedule=schedule,
                                transport=transport, microbatch_shape=(self.run_cfg.microbatch_size, self.tp.seq_len),
                                source_width=cfg.source_width, residual_width=cfg.d_model, dtype=hop_dtype)

        self.runtime = runtime(self.schedule, transport)
        self._transport_buffer_bytes = transport_buffer_bytes(transport)  # mapped for the whole run
        self.eval_runtime = runtime(self.eval_schedule, transport if eval_transport is None else eval_transport)

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: the hops carry activations and gradients of it."""
        return next(iter(self.params.values())).dtype

    # ---- one training step ----
    def begin_step(self, step: int, batch: RankBatch | None = None) -> None:
        """Start step `step` on this rank's microbatches (read from the data, or `batch` if given)."""
        inputs, targets = self._microbatches(self.data.train_microbatches(step) if batch is None
                                             else self.data.split(*batch))
        self.runtime.transport.ledger.clear()
        self.runtime.start_step(self.tp.shard(inputs), self.tp.shard(targets),
                                self.tp.loss_scale(self.run_cfg.train.microbatches))

    def run_step(self, step: int) -> StepRecord:
        """This rank's action list to the end; gradients accumulate in the parameters."""
        if step == self.fail_at_step:
            for _ in range(len(self.runtime.actions) // 2):
                self.runtime.run_next()
            lose_this_rank()
        return self._run_to_end(self.runtime)

    def _run_to_end(self, runtime: StageRuntime) -> StepRecord:
        """A started runtime to its end: alone, or in turns with the other thread ranks."""
        if self.peers is None:
            return runtime.run_to_end()
        self.peers.run_together(self.rank, runtime, "pipeline")
        return runtime.finish_step()

    def sync_gradients(self) -> None:
        sharded_experts = self.fsdp is not None and self.fsdp.sharded_experts  # reduce-scattered over edp
        if not sharded_experts:
            ensure_grads(self.experts)  # a slice that got no token: zeros, so every holder joins its sums
        if self.fsdp is not None:  # the shards' reduce-scatter averages over the replicas
            self.fsdp.reduce()
            ensure_grads(self.untied)
            if self.tp.active:
                self.tp.sum_partial_grads(self.untied + self.experts, self.collectives)
            sync_gradients(self.fsdp.replicated, self.tied, self.collectives, self.run_cfg.pipeline.data_parallel,
                           tied_copies=self.tp.tied_copies)
        else:
            if self.tp.active:
                self.tp.sum_partial_grads(self.untied + self.experts, self.collectives)
            sync_gradients(self.untied, self.tied, self.collectives, self.run_cfg.pipeline.data_parallel,
                           tied_copies=self.tp.tied_copies)
        self.tied_emb.sync(self.params, self.collectives)
        if self.run_cfg.pipeline.expert_parallel > 1 and not sharded_experts:
            sync_expert_gradients(self.experts, self.collectives, self.run_cfg.pipeline.data_parallel)
        self._grad_bytes = grad_bytes(self.params.values())  # before the optimizer step drops them

    def optimizer_step(self, lr: float) -> float:
        """Global-norm clipping and AdamW on synced gradients; returns the whole model's norm."""
        groups = norm_groups(self.tied_emb.counted(self.params, self.untied), self.tied, is_split=is_split,
                             tensor_parallel=self.tp.active, fsdp_replicated=getattr(self.fsdp, "replicated", None),
                             experts=self.experts if self.run_cfg.pipeline.expert_parallel > 1 else None,
                             experts_sharded=self.fsdp is not None and self.fsdp.sharded_experts)
        # A lone rank's norm is its own, its parameters' squares summed in the model's order.
        reducer = None if self.run_cfg.pipeline.world_size == 1 else norm_reducer(groups, self.collectives, self.device)
        return optimizer_step(self.optimizer, self.params.values(), lr, self.run_cfg.train.grad_clip, reducer)

    def backward(self, step: int, batch: RankBatch | None = None) -> StepRecord:
        """Forward and backward of step `step`, then the gradient sync: the synced gradients are left
        in the parameters (tests read them there)."""
        self.begin_step(step, batch)
        if self.tp.active and self.tp_bytes is None:  # counted once: the same every step
            from attnres_pp.pipeline.tp_bytes import TensorParallelBytes

            with TensorParallelBytes(self.tp_group) as counter:
                record = self.run_step(step)
                self.sync_gradients()
            self.tp_bytes = counter.sent_bytes
            return record
        record = self.run_step(step)
        self.sync_gradients()
        return record

    def memory(self, record: StepRecord) -> dict:
        """This rank's `memory_per_rank` entry for the step of `record` (after its optimizer step)."""
        return memory_entry(self.params.values(), self.optimizer, grad_bytes=self._grad_bytes,
                            activation_peak_bytes=record.activation_peak_bytes,
                            cache_peak_bytes=record.cache_peak_bytes, device=self.device,
                            transport_buffer_bytes=getattr(self, "_transport_buffer_bytes", 0))

    def train_step(self, step: int, lr: float, batch: RankBatch | None = None, want_events: bool = False) -> StepReply:
        """One optimiser step: forward/backward, gradient sync, global-norm clipping, AdamW, then the
        MoE sublayers' balancing (`balance_experts`)."""
        if self.rehearse:  # ATTNRES_PP_FREEZE_RANK: this process stops here, as a hung rank does
            rehearse_freeze(self.rank, step)
        rehearse_slow_step(self.slow_step_s)
        record = self.backward(step, batch)
        grad_norm = self.optimizer_step(lr)
        return self.reply(record, grad_norm, want_events)._replace(moe=self.balance_experts())

    def _microbatches(self, lists: MicrobatchLists) -> MicrobatchLists:
        return tuple(None if mbs is None else [t.to(self.device) for t in mbs] for mbs in lists)

    def reply(self, record: StepRecord, grad_norm: float, want_events: bool) -> StepReply:
        events = record.events
        ledger = self.runtime.transport.ledger.records
        return StepReply(
            rank=self.rank, loss_sum=sum(record.losses.values()), n_losses=len(record.losses), grad_norm=grad_norm,
            busy_s=sum(e.end_s - e.start_s for e in events if e.category == "compute"),
            first_s=min(e.start_s for e in events), last_s=max(e.end_s for e in events),
            bytes_sent=sum(r[4] for r in ledger),
            hop_tensors=tuple(sorted({(hop, n) for d, hop, mb, n, _ in ledger if d == "fwd" and mb == 0})),
            cache_peak_bytes=record.cache_peak_bytes, peak_rss_bytes=peak_rss_bytes(),
            events=tuple((self.rank, e.name, e.start_s, e.end_s, e.category) for e in events) if want_events else None,
            memory=self.memory(record),
            tp_bytes=self.tp_bytes or 0,
        )

    # ---- evaluation: the forward-only schedule on the training ranks ----
    def begin_eval(self, index: int, batch: RankBatch | None = None) -> None:
        inputs, targets = self._microbatches(self.data.val_microbatches(index) if batch is None
                                             else self.data.split(*batch, self.run_cfg.eval_microbatches))
        self.eval_runtime.start_step(self.tp.shard(inputs), self.tp.shard(targets), 1.0, forward_only=True)

    def evaluate(self, batches: list[RankBatch] | None = None) -> tuple[float, int]:
        """Forward-only passes over the run's validation batches (or `batches`): (sum of microbatch
        losses, their number); (0.0, 0) on a rank without the last chunk."""
        total, count = 0.0, 0
        for index in range(self.run_cfg.train.eval_batches if batches is None else len(batches)):
            self.begin_eval(index, None if batches is None else batches[index])
            record = self._run_to_end(self.eval_runtime)
            total, count = total + sum(record.losses.values()), count + len(record.losses)
        return total, count

    # ---- routing statistics (--log-routing-every): a forward-only pass with a probe on this rank's reads ----
    def begin_routing(self, index: int = 0) -> None:
        """Attach a probe to this rank's depth reads and start the forward of validation batch `index`."""
        self.routing_probe = RoutingProbe(self.run_cfg.model)
        set_probe(self.model, self.routing_probe)
        self.begin_eval(index)

    def finish_routing(self) -> dict[int, tuple[float, float, int]]:
        """Detach the probe; the sums of the sites this rank owns (scalars, `RoutingProbe.token_sums`)."""
        set_probe(self.model, None)
        return self.routing_probe.token_sums()

    @torch.no_grad()
    def routing_sums(self, index: int = 0) -> dict[int, tuple[float, float, int]]:
        self.begin_routing(index)
        try:
            self._run_to_end(self.eval_runtime)
        finally:
            sums = self.finish_routing()
        return sums

    # ---- checkpoints and the run directory ----
    @property
    def rng_stream(self) -> str:
        """What this rank's RNG state belongs to: its replica and the layers of its chunks."""
        return rng_stream(self.dp_rank, [self.partition.layer_range(c) for c in self.partition.chunks_of(self.pp_rank)])

    def transport_bytes(self) -> dict[str, int]:
        """Bytes this rank sent in its last training step, by way ("shm", "gloo")."""
        return self.runtime.transport.ledger.bytes_by_transport()

    def sees_file(self, path: str, token: str) -> tuple[bool, str]:
        """Whether `path` exists here and holds `token` (the driver's probe of a shared --out)."""
        try:
            return Path(path).read_text() == token, socket.gethostname()
        except OSError:
            return False, socket.gethostname()
