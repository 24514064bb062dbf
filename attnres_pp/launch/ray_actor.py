"""Each rank of `--launcher ray` as an actor (`RankActor`, a thin shell around the worker it hosts:
training's StageWorker, generation's GenerationWorker) and the replies of the actors' process-group
set-up (`join_results`): a refusal, a dead actor and a mesh that cannot connect told apart, lowest
rank first, each one line. Used by `ray_rank_group`, which places the actors."""

from __future__ import annotations

import os
import socket
import time

from attnres_pp.launch.rank_group import FAILURE_GRACE_S
from attnres_pp.launch.ray_checks import RendezvousError, actor_label, where_rank
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.stage_setup import bind_to_address


class RankActor:
    """One rank: `worker_cls(**kwargs)` plus what only the actor knows (its node, its GPUs)."""

    def __init__(self, worker_cls: type, kwargs: dict) -> None:
        import ray

        self.name = worker_cls.__name__.replace("Worker", "Actor")
        # Where this rank runs as Ray knows it: the node id decides shared memory vs the network
        # (`comm.pair_transport`), the node's address carries the process group's sockets.
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.worker = worker_cls(**kwargs)
        self.worker.node_id, self.worker.node_ip = self.node_id, self.node_ip

    def __repr__(self) -> str:
        worker = getattr(self, "worker", None)
        if worker is None:
            return "RankActor"
        return actor_label(self.name, worker)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address) of this rank."""
        return self.node_id, self.node_ip

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it, for the tcp:// rendezvous (Ray Train's way)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((self.node_ip, 0))
            return self.node_ip, probe.getsockname()[1]

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def see_node_gpus(self, visible: str, local_rank: int) -> None:
        """Before CUDA starts here: see every GPU of this node's ranks, use the `local_rank`-th."""
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        os.environ["LOCAL_RANK"] = str(local_rank)

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        """The worker's, with gloo's sockets on the interface of the node's address. A mesh that
        cannot connect is RendezvousError (one line: this rank, its address, the cause)."""
        interface = bind_to_address(self.node_ip)
        try:
            described = self.worker.join_process_group(init_method, world_size)
        except RuntimeError as error:
            cause = " ".join(str(error).split())[:300]
            raise RendezvousError(f"rank {self.worker.rank} at {self.node_ip} ({interface}) could not join the "
                                  f"process group at {init_method}: {cause}") from None
        described.update(node=self.node_id, address=self.node_ip, interface=interface)
        print(f"chunks {sorted(self.worker.chunks)} ({described['params']:,} parameters) on {self.worker.device} of "
              f"{described['host']}, node {self.node_ip} ({self.node_id[:8]}, {interface}), {described['backend']} "
              f"group of {world_size} via {init_method}", flush=True)
        return described


def join_results(refs: list, init_method: str, timeout_s: float, rank_nodes: list[tuple[str, str]]) -> list:
    """The ranks' process-group set-up replies; RendezvousError naming every rank's address and the
    first rank's failure when the group does not connect (a rank that dies is still WorkerLost). A
    rank that refuses to start (a ValueError in its set-up, such as a /dev/shm without room for the
    shared-memory slots) is one line, as under the local launcher: `rank R refused to start: ...`."""
    import ray

    ready, cut_short = _wait_for_setup(refs, timeout_s + 30.0)
    failures, refusals, still_waiting, lost = [], [], [], []
    for rank, ref in enumerate(refs):
        if ref not in ready:
            still_waiting.append(f"rank {rank} was still waiting for its peers" if cut_short
                                 else f"rank {rank} did not finish within {timeout_s:.0f} s")
            continue
        try:
            ray.get(ref, timeout=1.0)
        except ray.exceptions.RayActorError as error:
            lost.append(WorkerLost(rank, f"{where_rank(rank_nodes, rank)} died during process-group setup: {error}"))
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, ValueError) and not isinstance(cause, RendezvousError):
                refusals.append(f"rank {rank} refused to start: {' '.join(str(cause).split())}")
            else:
                failures.append(str(cause) if isinstance(cause, RendezvousError)
                                else f"rank {rank}: {' '.join(str(error).split())[-300:]}")
    # Lowest rank first: a refusal (the cause, naming the fix), then an actor that died, then the
    # failures that follow from either (a peer that gave up, a rank left waiting).
    if refusals:
        raise ValueError(refusals[0])
    if lost:
        raise lost[0]
    failures += still_waiting  # a rank's own failure names the cause; a peer left waiting only follows from it
    if failures:
        where = ", ".join(f"rank {r} at {ip}" for r, (_node, ip) in enumerate(rank_nodes))
        raise RendezvousError(f"the process group of ranks 0-{len(refs) - 1} ({where}) did not connect at "
                              f"{init_method}: {failures[0]}; check that every node reaches the others at "
                              "these addresses (routes, firewalls) and that each node's --node-ip-address "
                              "is its own")
    return ray.get(refs)


def _wait_for_setup(refs: list, timeout_s: float) -> tuple[list, bool]:
    """(the replies in, whether the wait was cut short by a failed rank): every reply, or what came
    within `timeout_s`, or within FAILURE_GRACE_S of the first failure (a peer of a mesh that cannot
    connect would otherwise wait out its whole timeout for a rank that has given up)."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending, ready, cut_short = list(refs), [], False
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        ready += done
        for ref in done:
            try:
                ray.get(ref, timeout=1.0)
            except Exception:  # its kind is sorted out by the caller
                if not cut_short:
                    cut_short, deadline = True, min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return ready, cut_short and bool(pending)
