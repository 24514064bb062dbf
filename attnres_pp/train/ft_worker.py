"""FtStageWorker: a `StageWorker` in a torchft replica group (`--fault-tolerance replicas`,
`train.ft_engine`). Replica d's P ranks form a world of their own (their pipeline p2p and the
gradient norm's sum over pp), so one group can be restarted alone; each rank runs a torchft
`Manager` (replica id = d, group rank = pp rank, group world size = P) whose fault-tolerant gloo
process group averages stage p's gradients with stage p of the other participating groups, in
place of the mesh's dp axis. A step is applied only where `manager.should_commit()` agrees.

The step a rank trains is the Manager's (`current_step()`): the one its group committed last plus
one, or, for a group that joins after a restart, the step of the live groups it heals from. A
healing rank receives from the same pp rank of a live group, through the Manager's state-dict
callbacks (torchft's checkpoint transport, not the disk), its parameters, AdamW state and RNG state.

Under Ray a group's ranks, and the groups, may run on different nodes: rank 0's store, its
ManagerServer and every rank's checkpoint server are advertised at the rank's node address.

torchft is imported here only: a run without `--fault-tolerance replicas` never needs it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from datetime import timedelta

import torch

from attnres_pp.pipeline.mesh import RankCoords
from attnres_pp.train.grad_sync import ensure_grads, flat_buckets
from attnres_pp.train.optim import lr_at
from attnres_pp.train.stage_worker import StageWorker
from attnres_pp.train.step_stats import StepReply


class PipelineCollectives:
    """The collectives of a rank whose process group is its replica's P ranks: only the "pp" axis
    (the gradient norm's sum); the replicas' axis goes through the torchft Manager."""

    def __init__(self, coords: RankCoords) -> None:
        self.coords = coords

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        import torch.distributed as dist

        if axis != "pp":
            raise ValueError(f"axis {axis!r}: a replica group's process group holds only its pp ranks")
        if self.coords.stages > 1:
            dist.all_reduce(tensor)


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
        self.store = None  # rank 0's TCPStore, the group's rendezvous for its Managers

    @property
    def process_group_rank(self) -> int:
        return self.pp_rank

    def pipeline_peers(self) -> list[int]:
        return list(range(self.run_cfg.pipeline.stages))

    def make_collectives(self, device: torch.device) -> PipelineCollectives:
        return PipelineCollectives(self.coords)

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        """Join this replica's P-rank process group, then start this rank's torchft Manager (the
        group's rank 0 hosts the TCPStore the group's Managers meet at and serves the group's
        ManagerServer, which joins the Lighthouse)."""
        import torch.distributed as dist

        described = super().join_process_group(init_method, world_size)
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ValueError("--fault-tolerance replicas needs torchft: pip install 'attnres-pp[ft]'") from None
        logging.getLogger("torchft").setLevel(logging.ERROR)  # a warning per quorum on CPU (no NCCL recorder)
        timeout = timedelta(seconds=self.run_cfg.pipeline.timeout_s)
        # Under Ray what a rank serves may be reached from other nodes: the store by this group's other
        # ranks and, for the replicas' reduction, by the other groups' (the quorum hands them its
        # address); the ManagerServer and the checkpoint server by a healing group. So each is
        # advertised at its rank's node address, the one the cluster knows: a host name may not
        # resolve on another node, or resolve to loopback. Local rank processes share this machine.
        reached_at = self.node_ip if self.run_cfg.pipeline.launcher == "ray" and self.node_ip else None
        store_host = reached_at or "127.0.0.1"
        if self.pp_rank == 0:
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
            connect_timeout=timeout, rank=self.pp_rank, world_size=self.run_cfg.pipeline.stages,
            store_addr=store_host, store_port=store_port, lighthouse_addr=self.lighthouse,
            replica_id=f"replica_{self.dp_rank}", init_sync=False, **advertised)
        return described

    # ---- healing: what a live group's rank sends the same pp rank of a joining group ----
    def peer_state(self) -> dict:
        return {"params": {name: p.detach() for name, p in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}

    def load_peer_state(self, state: dict) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])

    # ---- one fault-tolerant step ----
    def sync_gradients(self) -> None:
        """Average the gradients over the participating replica groups through the Manager (AVG:
        the sum divided by the participants); MSAR's tied convolutions are first summed over this
        group's P ranks. A failed reduction is the Manager's error: the step does not commit."""
        ensure_grads(self.untied + self.tied)
        if self.fail_in_allreduce_at is not None and self.manager.current_step() == self.fail_in_allreduce_at:
            os._exit(17)
        for bucket in flat_buckets(self.untied):
            self._average(bucket)
        if self.tied:
            flat = torch.cat([p.grad.reshape(-1) for p in self.tied])
            self.collectives.all_reduce(flat, "pp")
            self._write_back(self.tied, flat)
            self._average(self.tied)

    def _average(self, params: list) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.manager.allreduce(flat).wait()
        self._write_back(params, flat)

    @staticmethod
    def _write_back(params: list, flat: torch.Tensor) -> None:
        for p, piece in zip(params, flat.split([p.grad.numel() for p in params]), strict=True):
            p.grad.copy_(piece.view_as(p.grad))

    def ft_step(self, want_events: bool = False) -> tuple[int, bool, int, StepReply]:
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
        record = self.backward(step)
        participants = self.manager.num_participants()
        if self.manager.should_commit():
            return step, True, participants, self.reply(record, self.optimizer_step(lr_at(step, self.run_cfg.train)),
                                                         want_events)
        self.optimizer.zero_grad(set_to_none=True)
        return step, False, participants, self.reply(record, math.nan, want_events)

    def ft_heal(self) -> int:
        """One quorum round without training (after the run's last step): a rank whose group is behind
        heals from the same pp rank of a group that committed it. Returns the Manager's step."""
        self.manager.start_quorum()
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """The Manager's step after a checkpoint load: the step the loaded state trains next."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def param_digest(self) -> str:
        """sha256 of this rank's parameters, by name (replica groups compare them bitwise)."""
        digest = hashlib.sha256()
        for name in sorted(self.params):
            digest.update(name.encode())
            digest.update(self.params[name].detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        super().close()
