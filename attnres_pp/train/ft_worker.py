"""FtStageWorker: a `StageWorker` in a torchft replica group (`--fault-tolerance replicas`,
`train.ft_replicas`). Replica d's P x T ranks (P stages, each chunk shared by T tensor-parallel ranks)
form a world of their own (their pipeline p2p, the tp mesh's collectives, the gradient norm's sums
over pp and tp), so one group can be restarted alone; each rank runs a torchft `Manager` (replica id
= d, group rank = its index in the group, pp_rank x T + tp_rank, tp innermost as the mesh lays ranks
out; group world size = P x T) whose fault-tolerant gloo process group averages this rank's gradient
shards with those of the same group rank of the other participating groups, in place of the mesh's
dp axis. A step is applied only where `manager.should_commit()` agrees.

The step a rank trains is the Manager's (`current_step()`): the one its group committed last plus
one, or, for a group that joins after a restart, the step of the live groups it heals from. A
healing rank receives from the same group rank of a live group, through the Manager's state-dict
callbacks (torchft's checkpoint transport, not the disk), its parameters, AdamW state and RNG state;
a tensor-parallel weight and its AdamW moments travel as the rank's local shard (`local_state`) and
are made DTensors of this rank's mesh again on arrival (`load_local_state`).

Under Ray a group's ranks, and the groups, may run on different nodes: rank 0's store, its
ManagerServer and every rank's checkpoint server are advertised at the rank's node address.

torchft is imported here only: a run without `--fault-tolerance replicas` never needs it.
"""

from __future__ import annotations

import hashlib
import math
from datetime import timedelta

import torch

from attnres_pp.model.moe import moe_sublayers, take_aux, take_loads
from attnres_pp.pipeline.mesh import MeshCollectives, RankCoords
from attnres_pp.train.faults import lose_this_rank, rehearse_slow_step
from attnres_pp.train.ft_noise import hold_torchft_errors, quiet_checkpoint_server
from attnres_pp.train.grad_sync import ensure_grads, flat_buckets, reduce_flat
from attnres_pp.train.memory_report import grad_bytes
from attnres_pp.train.optim import local_shard, lr_at
from attnres_pp.train.shards import rng_stream
from attnres_pp.train.stage_worker import StageWorker
from attnres_pp.train.step_stats import StepReply


def group_rank(coords: RankCoords) -> int:
    """The rank's index in its replica group, pp_rank x T + tp_rank (tp innermost, as the mesh lays
    ranks out): its rank in the group's process group and its torchft Manager's group rank, which
    pairs it with the rank of the same (pp, tp) coordinates in every other group."""
    return coords.pp_rank * coords.tensor_parallel + coords.tp_rank


def group_coords(coords: RankCoords) -> RankCoords:
    """The rank's coordinates in its replica group's process group: those of a one-replica run."""
    return RankCoords(group_rank(coords), 1, coords.stages, coords.tensor_parallel)


class ReplicaGroupCollectives:
    """The collectives of a rank whose process group is its replica group's P x T ranks: "pp" (the
    gradient norm's sum), "tp" (the split layers' partial gradients and their norm) and "world" (the
    group's ranks: MSAR's tied convolutions); the replicas' axis ("dp") goes through the torchft
    Manager. At T > 1 they run over the group's ("dp", "pp", "tp") DeviceMesh of one replica, whose
    `mesh["tp"]` the layers are split over; at T = 1 the group's ranks are its pp ranks and no mesh
    is built."""

    def __init__(self, coords: RankCoords, device_type: str) -> None:
        self.coords = coords
        self._mesh = MeshCollectives(group_coords(coords), device_type) if coords.tensor_parallel > 1 else None
        self.mesh = None if self._mesh is None else self._mesh.mesh

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        import torch.distributed as dist

        if axis == "dp":
            raise ValueError("axis 'dp': a replica group's process group holds one replica; the replicas reduce "
                             "through the torchft Manager")
        if self._mesh is not None:
            self._mesh.all_reduce(tensor, axis)
        elif axis not in ("pp", "world", "tp"):
            raise ValueError(f"axis {axis!r} is unknown: choose pp, tp or world")
        elif axis != "tp" and self.coords.stages > 1:
            dist.all_reduce(tensor)


def local_state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict:
    """What a live rank sends the same group rank of a healing group: its parameters and optimizer
    state, every DTensor as its local shard. Plain tensors only: torchft's transport pickles what
    the state_dict callback returns, and a DTensor would carry its mesh and process group along."""
    optim = optimizer.state_dict()
    return {"params": {name: local_shard(p.detach()) for name, p in params.items()},
            "optimizer": {**optim, "state": {index: {key: local_shard(value) if torch.is_tensor(value) else value
                                                     for key, value in entry.items()}
                                             for index, entry in optim["state"].items()}}}


def load_local_state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`local_state`'s counterpart, in place: each parameter's local shard copied in, and the optimizer
    state loaded with every moment of a DTensor parameter (a tensor of its local shard's shape) made a
    DTensor of that parameter's mesh and placements again (the sender's layout is this rank's: the
    same group rank of the same run). The step counts stay plain tensors, as AdamW keeps them."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in params.items():
            local_shard(p.detach()).copy_(state["params"][name])
    ordered = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's indices

    def as_held(p: torch.Tensor, value):
        if isinstance(p, DTensor) and torch.is_tensor(value) and value.shape == p.to_local().shape:
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return value

    optim = state["optimizer"]
    optimizer.load_state_dict({**optim, "state": {index: {key: as_held(ordered[index], value)
                                                          for key, value in entry.items()}
                                                  for index, entry in optim["state"].items()}})


def url_host(address: str) -> str:
    """`address` as the host part of a URL (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address else address


def node_checkpoint_transport(address: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport advertising `address`, the node's, instead of this host's
    name (which another node may not resolve, or resolve to its own loopback); it serves on every
    interface either way."""
    from torchft.checkpointing import HTTPTransport

    class NodeHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{url_host(address)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return NodeHTTPTransport(timeout=timeout, num_chunks=0)


class FtStageWorker(StageWorker):
    """`lighthouse`: the torchft Lighthouse's URL; `min_replicas`: the groups a step needs to commit."""

    def __init__(self, run_cfg_dict: dict, rank: int, *, lighthouse: str, fail_in_allreduce: bool = False,
                 **kwargs) -> None:
        super().__init__(run_cfg_dict, rank, **kwargs)
        self.lighthouse = lighthouse
        # The rehearsal's point (`--inject-failure R:S:allreduce`): at step S this rank trains its
        # pipeline to the end and exits as it would join the replicas' reduction, which its peers in
        # the other groups have entered: the failure they see is one inside the collective.
        self.fail_in_allreduce_at = self.fail_at_step if fail_in_allreduce else None
        if fail_in_allreduce:
            self.fail_at_step = None
        self.manager = None
        self.held_errors = None  # torchft's log records until a step commits (`ft_noise`)
        self.store = None  # rank 0's TCPStore, the group's rendezvous for its Managers

    @property
    def rng_stream(self) -> str:
        """The layers' stream, under replica 0's name whichever group this is: every group holds the
        same state (one live group writes a checkpoint, and a joining group heals from a live one, RNG
        state included), so every group loads the stream the writing group saved."""
        return rng_stream(0, [self.partition.layer_range(c) for c in self.partition.chunks_of(self.pp_rank)])

    @property
    def process_group_rank(self) -> int:
        return group_rank(self.coords)

    def pipeline_peers(self) -> list[int]:
        """The group ranks of this rank's pipeline: this tp rank's, one per stage."""
        t = self.run_cfg.pipeline.tensor_parallel
        return [p * t + self.coords.tp_rank for p in range(self.run_cfg.pipeline.stages)]

    def make_collectives(self, device: torch.device) -> ReplicaGroupCollectives:
        return ReplicaGroupCollectives(self.coords, device.type)

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        """Join this replica's P x T-rank process group, then start this rank's torchft Manager (the
        group's rank 0 hosts the TCPStore the group's Managers meet at and serves the group's
        ManagerServer, which joins the Lighthouse)."""
        import torch.distributed as dist

        described = super().join_process_group(init_method, world_size)
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ValueError("--fault-tolerance replicas needs torchft: pip install 'attnres-pp[ft]'") from None
        self.held_errors = hold_torchft_errors()  # shown only if this rank fails
        timeout = timedelta(seconds=self.run_cfg.pipeline.timeout_s)
        # Under Ray what a rank serves may be reached from other nodes: the store by this group's other
        # ranks and, for the replicas' reduction, by the other groups' (the quorum hands them its
        # address); the ManagerServer and the checkpoint server by a healing group. So each is
        # advertised at its rank's node address, the one the cluster knows: a host name may not
        # resolve on another node, or resolve to loopback. Local rank processes share this machine.
        reached_at = self.node_ip if self.run_cfg.pipeline.launcher == "ray" and self.node_ip else None
        store_host = reached_at or "127.0.0.1"
        if self.process_group_rank == 0:
            self.store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        where = [(store_host, self.store.port) if self.store is not None else None]
        dist.broadcast_object_list(where, src=0)
        store_host, store_port = where[0]
        advertised = {} if reached_at is None else {
            "hostname": url_host(reached_at), "checkpoint_transport": node_checkpoint_transport(reached_at, timeout)}
        train = self.run_cfg.train
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self.load_peer_state, state_dict=self.peer_state,
            min_replica_size=train.min_replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=self.process_group_rank,
            world_size=self.coords.stages * self.coords.tensor_parallel,
            store_addr=store_host, store_port=store_port, lighthouse_addr=self.lighthouse,
            replica_id=f"replica_{self.dp_rank}", init_sync=False, **advertised)
        quiet_checkpoint_server(self.manager)
        return described

    # ---- healing: what a live group's rank sends the same group rank of a joining group ----
    def peer_state(self) -> dict:
        return {**local_state(self.params, self.optimizer), "rng": torch.get_rng_state()}

    def load_peer_state(self, state: dict) -> None:
        load_local_state(self.params, self.optimizer, state)
        torch.set_rng_state(state["rng"])

    # ---- one fault-tolerant step ----
    def sync_gradients(self) -> None:
        """Average the gradients over the participating replica groups through the Manager (AVG:
        the sum divided by the participants), each rank its local shards with the same group rank
        of the others. Under sequence parallelism the partial gradients of what every tp rank holds
        whole are first summed over tp, as without fault tolerance; MSAR's tied convolutions are
        first summed over this group's P x T ranks (divided by the tp ranks that computed the same
        ones). A failed reduction is the Manager's error: the step does not commit."""
        ensure_grads(self.untied + self.tied)
        if self.fail_in_allreduce_at is not None and self.manager.current_step() == self.fail_in_allreduce_at:
            lose_this_rank()
        if self.tp.active:
            self.tp.sum_partial_grads(self.untied, self.collectives)
        for bucket in flat_buckets(self.untied):
            self._average(bucket)
        if self.tied:
            reduce_flat(self.tied, lambda flat: self.collectives.all_reduce(flat, "world"), self.tp.tied_copies)
            self._average(self.tied)
        moes = moe_sublayers(self.model)
        if moes:  # inside the step, before should_commit: the Manager reduces only within a step
            self._loads_LE = take_loads(moes).to(self.device)
            self.manager.allreduce(self._loads_LE).wait()
        self._grad_bytes = grad_bytes(self.params.values())  # before the optimizer step drops them

    def step_loads(self, moes: dict) -> torch.Tensor:
        """The loads `sync_gradients` averaged over the participating groups, back to their sum (token
        counts: whole numbers, so the rounding restores them exactly)."""
        return torch.round(self._loads_LE.cpu() * self.manager.num_participants())

    def _average(self, params: list) -> None:
        reduce_flat(params, lambda flat: self.manager.allreduce(flat).wait())

    def ft_step(self, want_events: bool = False) -> tuple[int, bool, int, StepReply]:
        """`_ft_step`, with what torchft logged meanwhile dropped once a step commits (the group
        recovered) and attached to the error if the step fails."""
        try:
            result = self._ft_step(want_events)
        except BaseException as error:
            self.held_errors.attach(error)
            raise
        if result[1]:
            self.held_errors.drop()
        return result

    def _ft_step(self, want_events: bool) -> tuple[int, bool, int, StepReply]:
        """Join the step's quorum (healing first if this group is behind), train the Manager's step,
        and apply it where `should_commit` agrees. Returns (step, committed, participating groups,
        this rank's StepReply; its grad_norm is nan when the step did not commit)."""
        try:
            self.manager.start_quorum()
        except Exception as error:  # torchft's quorum wait raises its own TimeoutError
            raise RuntimeError(f"no quorum of --min-replicas {self.run_cfg.train.min_replicas} replica groups within "
                               f"--timeout {self.run_cfg.pipeline.timeout_s:g} s "
                               f"({(str(error).splitlines() or [''])[0]})") from None
        step = self.manager.current_step()
        rehearse_slow_step(self.slow_step_s)  # ATTNRES_PP_SLOW_STEP_S: pacing for a test's fault from outside
        record = self.backward(step)
        participants = self.manager.num_participants()
        if self.manager.should_commit():
            grad_norm = self.optimizer_step(lr_at(step, self.run_cfg.train))
            return step, True, participants, self.reply(record, grad_norm, want_events)._replace(
                moe=self.balance_experts())
        self.optimizer.zero_grad(set_to_none=True)
        take_aux(moe_sublayers(self.model))  # the step did not happen: neither did its aux losses
        return step, False, participants, self.reply(record, math.nan, want_events)

    def ft_heal(self) -> int:
        """One quorum round without training (after the run's last step): a rank whose group is behind
        heals from the same group rank of a group that committed it. Returns the Manager's step."""
        self.manager.start_quorum()
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """The Manager's step after a checkpoint load: the step the loaded state trains next."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def param_digest(self) -> str:
        """sha256 of this rank's parameters (a DTensor's local shard), by name (replica groups compare
        them bitwise, group rank by group rank)."""
        digest = hashlib.sha256()
        for name in sorted(self.params):
            digest.update(name.encode())
            held = local_shard(self.params[name].detach())
            digest.update(held.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        super().close()
