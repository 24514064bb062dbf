"""`--launcher inprocess`: a whole D x P run in one process, for debugging and fast tests.

The same `StageWorker`s as the other launchers, one per global rank, each holding only its chunks.
Pipeline hops go over the loopback transport (one mailbox per replica), and the ranks take turns
action by action (a receive runs only once its message is in the mailbox: the unit-step execution
the validator proves deadlock-free). After the backward every rank runs the gradient sync and the
optimiser step in its own thread, so the collectives between ranks (`mesh.ThreadCollectives`)
block as they do between processes.

Nothing crosses a process boundary here; `driver_bytes_per_step` reports what the same requests
and replies measure pickled, the bytes the local launcher's pipes would carry.

The driver decides the device (`train.devices`, one process: a GPU if one is visible) and every
rank computes there. With `p2p_semantics="nccl"` each replica's loopback enforces NCCL's
point-to-point rules (`loopback_nccl`: in-order matching, rendezvous sends) and the runtimes issue
their messages in NCCL's order, so a schedule that would hang on NCCL hangs here, on the CPU.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading

import torch

from attnres_pp.comm.transport import LoopbackTransport
from attnres_pp.data import Corpus
from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.loopback import run_in_turns
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.pipeline.mesh import thread_collectives
from attnres_pp.pipeline.runtime import StageRuntime, StepRecord
from attnres_pp.schedule.validate_nccl import NcclP2P
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.pipeline_engine import PipelineEngineBase, mean_eval_loss
from attnres_pp.train.shards import save_shard, shard_state
from attnres_pp.train.stage_worker import StageWorker


class InProcessEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, corpus: Corpus | None = None,
                 record_timelines: bool = False) -> None:
        # Every rank lives in this process, on one device: a GPU if one is visible (or asked for).
        decision = decide_device(run_cfg.train.device, n_ranks=run_cfg.pipeline.world_size, one_process=True,
                                 gpus=visible_gpus())
        run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
        super().__init__(run_cfg, out_dir, record_timelines=record_timelines)
        pipe = run_cfg.pipeline
        self.timeout_s = pipe.timeout_s
        self.device = torch.device(decision.device)
        collectives = thread_collectives(pipe.data_parallel, pipe.stages, pipe.timeout_s)
        self.workers = [StageWorker(run_cfg.to_dict(), rank, corpus=corpus) for rank in range(self.world_size)]
        nccl_rules = pipe.resolved_p2p("loopback") == "nccl"
        # One loopback per replica: a mailbox (gloo's rules) or an NCCL point-to-point model.
        fabrics = [NcclP2P(pipe.stages) if nccl_rules else {} for _ in range(pipe.data_parallel)]
        for worker in self.workers:
            fabric = fabrics[worker.dp_rank]
            transport = (NcclLoopbackTransport(worker.pp_rank, fabric) if nccl_rules
                         else LoopbackTransport(worker.pp_rank, fabric))
            worker.attach(self.device, transport, collectives[worker.rank])
        self._note_setup([w.describe("loopback") for w in self.workers])

    # ---- training ----
    def backward(self, step: int, inputs_BT: torch.Tensor | None = None,
                 targets_BT: torch.Tensor | None = None) -> list[StepRecord]:
        """Forward and backward of step `step` on every rank, then the gradient sync: the gradients
        of the whole run are left in the workers' parameters (tests read them there)."""
        for worker in self.workers:
            worker.begin_step(step, self._rank_batch(worker.rank, inputs_BT, targets_BT))
        records = _run_together([w.runtime for w in self.workers])
        self._in_threads(lambda worker: worker.sync_gradients())
        return records

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        want_events = self._wants_events(step)
        requests = [(step, lr, self._rank_batch(w.rank, inputs_BT, targets_BT), want_events) for w in self.workers]
        records = self.backward(step, inputs_BT, targets_BT)
        replies = self._in_threads(lambda w: w.reply(records[w.rank], w.optimizer_step(lr), want_events))
        driver_bytes = sum(len(pickle.dumps(x)) for x in requests) + sum(len(pickle.dumps(r)) for r in replies)
        return self._step_result(step, replies, driver_bytes)

    def _in_threads(self, fn) -> list:
        """fn(worker) for every worker, each in its own thread (they meet in collectives)."""
        if len(self.workers) == 1:
            return [fn(self.workers[0])]
        results: list = [None] * len(self.workers)
        errors: list[BaseException] = []

        def run(worker: StageWorker) -> None:
            try:
                results[worker.rank] = fn(worker)
            except BaseException as error:  # noqa: BLE001  (re-raised below, on the caller's thread)
                errors.append(error)

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in self.workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout_s + 30.0)
        if errors:
            raise errors[0]
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError(f"in-process ranks did not finish within {self.timeout_s:.0f} s")
        return results

    # ---- evaluation ----
    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Forward-only pipeline over one driver-given batch."""
        return self._evaluate([[self._rank_batch(w.rank, inputs_BT, targets_BT)] for w in self.workers])

    def evaluate(self) -> float:
        """Mean loss over the run's validation batches, each rank reading its own share."""
        return self._evaluate([None] * len(self.workers))

    def _evaluate(self, batches_by_rank: list) -> float:
        n_batches = self.run_cfg.train.eval_batches if batches_by_rank[0] is None else len(batches_by_rank[0])
        answers = []
        for index in range(n_batches):
            for worker, batches in zip(self.workers, batches_by_rank, strict=True):
                worker.begin_eval(index, None if batches is None else batches[index])
            records = _run_together([w.eval_runtime for w in self.workers])
            answers += [(sum(r.losses.values()), len(r.losses)) for r in records]
        return mean_eval_loss(answers)

    @torch.no_grad()
    def routing_metrics(self) -> dict:
        """Routing entropy and embedding weight per site on validation batch 0, each rank probing the
        reads of its own chunks (`StageWorker.begin_routing`); only their scalar sums are merged."""
        for worker in self.workers:
            worker.begin_routing(0)
        try:
            _run_together([w.eval_runtime for w in self.workers])
        finally:
            sums = [w.finish_routing() for w in self.workers]
        return routing_metrics(sums)

    # ---- checkpoints ----
    def save_checkpoint(self, step_dir) -> None:
        """One process writes for every rank: their states merged (replicas' equal copies once)."""
        state = {}
        for worker in self.workers:
            state.update(shard_state(worker.model, worker.params, worker.optimizer, worker.rng_stream))
        save_shard(step_dir, state, distributed=False)

    def load_checkpoint(self, step_dir) -> None:
        for worker in self.workers:
            worker.load_shard(str(step_dir))

    def close(self) -> None:
        """Nothing to release in one process."""


def _run_together(runtimes: list[StageRuntime]) -> list[StepRecord]:
    """Run started runtimes to the end, each taking its next action when it can; one record each."""
    run_in_turns(runtimes, "pipeline")
    return [runtime.finish_step() for runtime in runtimes]
