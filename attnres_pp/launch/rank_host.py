"""RankHost: the contract between a rank group and the worker it hosts on each rank, declared once.
Training's `StageWorker` and generation's `GenerationWorker` derive from it; the rank groups
(`process_rank_group`, `ray_rank_group`, `thread_rank_group`) call its methods by name.

A rank group builds `worker_cls(**kwargs)` on each rank, then joins it:
- in a rank process or Ray actor, `join_process_group(init_method, world_size)`: join the run's
  process group on the device the driver decided (`stage_setup.init_process_group`: gloo on CPU,
  nccl with the rank's own GPU), open the transport to the pipeline peers, attach the runtimes,
  split the layers over the tp ranks under tensor parallelism (`connect`);
- as a thread of the driver, `join_threads(device, transport, collectives, peers, tp_mesh)`: the
  same over the loopback transport the thread group wired, with `peers` where the thread ranks take
  their turns;
and each join returns `describe(backend)`, the rank's set-up reply. `close()` releases the
transport and leaves the process group. The Ray actor sets `node_id` and `node_ip` before the join.

A subclass sets `rank`, `pp_rank`, `coords` (a `pipeline.mesh.RankCoords`), `chunks` and `params`
in its constructor and supplies the parts that differ between training and generation:
`device_choice` and `timeout_s`, `open_transport`, `make_collectives`, `attach`, `split_layers`
and `held_params`.
"""

from __future__ import annotations

import os
import socket

import torch

from attnres_pp.pipeline.stage_setup import init_process_group


class RankHost:
    """The hosting contract (module docstring); subclasses supply the rank's own parts."""

    node_id: str | None = None  # the node this rank runs on, as its launcher knows it (Ray's node id)
    node_ip: str | None = None  # that node's address, where the launcher knows it (Ray's node IP)
    peers = None  # where thread ranks meet to run their actions in turns (`join_threads`)
    transport = None  # the pipeline transport the join opened or was handed
    distributed = False  # in a torch.distributed process group (`connect`)

    # ---- what a subclass supplies ----
    @property
    def device_choice(self) -> str:
        """"cpu" or "cuda", as the driver decided it for this rank."""
        raise NotImplementedError

    @property
    def timeout_s(self) -> float:
        """The bound on every wait of this rank's process group and transports."""
        raise NotImplementedError

    def open_transport(self, device: torch.device, backend: str) -> tuple:
        """(the pipeline transport, the evaluation's transport or None for the same) over the joined
        process group. Collective where the ranks must agree on it."""
        raise NotImplementedError

    def make_collectives(self, device: torch.device):
        """The collectives over the joined process group, or None where the rank needs none; under
        tensor parallelism their mesh has the "tp" axis."""
        raise NotImplementedError

    def attach(self, device: torch.device, transport, collectives, eval_transport=None) -> None:
        """Move this rank's chunks to `device` and build its runtimes over `transport`."""
        raise NotImplementedError

    def split_layers(self, tp_mesh) -> None:
        """Tensor parallelism: split the chunks' layers over `tp_mesh` (the params become DTensors)."""
        raise NotImplementedError

    def held_params(self) -> int:
        """Parameter elements this rank holds (its shards of split weights)."""
        raise NotImplementedError

    # ---- the contract the rank groups call ----
    @property
    def process_group_rank(self) -> int:
        """This rank's rank in the process group it joins: the global rank (one group of every rank)."""
        return self.rank

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        """Join the run's process group (gloo on CPU, nccl with this rank's GPU) and `connect`;
        returns `describe(backend)`."""
        backend, device = init_process_group(init_method, self.process_group_rank, world_size, self.timeout_s,
                                             self.device_choice)
        self.connect(device, backend)
        return self.describe(backend)

    def connect(self, device: torch.device, backend: str = "gloo") -> None:
        """Attach to the initialised default process group: the transport, the collectives, the
        runtimes, and under tensor parallelism the layers split over the mesh's tp axis."""
        self.transport, eval_transport = self.open_transport(device, backend)
        collectives = self.make_collectives(device)
        self.attach(device, self.transport, collectives, eval_transport=eval_transport)
        self.distributed = True
        if self.coords.tensor_parallel > 1:
            self.split_layers(collectives.mesh["tp"])

    def join_threads(self, device: torch.device, transport, collectives, peers, tp_mesh=None) -> dict:
        """Run as one of the threads of a `ThreadRankGroup`: hops over the loopback `transport`,
        collectives between threads, actions in turns with the others (`peers.run_together`); under
        tensor parallelism the layers split over `tp_mesh` (the tp axis of the threads' own mesh)."""
        self.peers, self.transport = peers, transport
        self.attach(device, transport, collectives)
        if self.coords.tensor_parallel > 1:
            self.split_layers(tp_mesh)
        return self.describe("loopback")

    def describe(self, backend: str) -> dict:
        """The set-up reply: backend, coordinates, chunks, parameters held, host and process id (a
        driver on the same host kills a hung rank by it)."""
        return {"backend": backend, "rank": self.rank, "pp_rank": self.pp_rank, "dp_rank": self.coords.dp_rank,
                "chunks": sorted(self.chunks), "params": self.held_params(), "host": socket.gethostname(),
                "pid": os.getpid()}

    def close(self) -> None:
        """Release the transport (the shared-memory transport's doorbells) and leave the process group."""
        import torch.distributed as dist

        if self.transport is not None:
            self.transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()
