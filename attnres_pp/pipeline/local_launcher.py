"""`--launcher local`: one spawned process per rank on this machine, gloo over a file-based
rendezvous in a temporary folder (no port hunting), one thread per rank.

The driver talks to each process over a pipe. Every wait is bounded: the driver polls with a
deadline and checks that the process is alive, so a dead rank becomes WorkerLost naming it, and
`restart_workers()` replaces every rank process (the training loop's recovery). Rank processes
ignore Ctrl-C: the driver, which receives it too, stops them in `close()`.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import tempfile
import time
import traceback

import torch

from attnres_pp.pipeline.engines import PipelineEngineBase, model_from_parameters
from attnres_pp.pipeline.worker import check_split
from attnres_pp.train.checkpoint import read_checkpoint, write_rank_file
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.recovery import WorkerLost

__all__ = ["ProcessEngine", "WorkerLost"]  # WorkerLost lives in train.recovery; re-exported for callers


def _serve(pp_rank: int, run_cfg_dict: dict, init_method: str, world_size: int, conn,
           fail_at_step: int | None) -> None:
    """The rank process: build the worker, join the group, then answer (method, args) requests."""
    from attnres_pp.pipeline.worker import StageWorker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = StageWorker(run_cfg_dict, pp_rank)
        worker.fail_at_step = fail_at_step
        conn.send(("ok", worker.join_process_group(init_method, world_size)))
    except Exception:  # report any setup failure to the driver rather than dying silently
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, args = conn.recv()
        if method == "close":
            worker.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class ProcessEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__(run_cfg, out_dir)
        check_split(run_cfg)  # a bad split fails here, in one line, before any process starts
        self.timeout_s = run_cfg.pipeline.timeout_s
        self._conns, self._procs, self._rendezvous_dir = [], [], None
        try:
            self._start_workers(fail_at)
        except BaseException:
            self._stop_workers(graceful=False)
            raise

    def _start_workers(self, fail_at: tuple[int, int] | None) -> None:
        pipe = self.run_cfg.pipeline
        self._rendezvous_dir = tempfile.mkdtemp(prefix="attnres-pp-rdzv-")
        init_method = f"file://{self._rendezvous_dir}/rendezvous"
        ctx = mp.get_context("spawn")
        for rank in range(pipe.stages):
            parent, child = ctx.Pipe()
            fail_at_step = fail_at[1] if fail_at is not None and fail_at[0] == rank else None
            proc = ctx.Process(target=_serve, name=f"attnres-pp-rank{rank}", daemon=True,
                               args=(rank, self.run_cfg.to_dict(), init_method, pipe.stages, child, fail_at_step))
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.backend = self._gather("setup")[0]
        self._eval_model = None

    def restart_workers(self) -> None:
        """Stop every rank process (survivors may be blocked on the lost one) and start fresh ones."""
        self._stop_workers(graceful=False)
        try:
            self._start_workers(None)
        except BaseException:
            self._stop_workers(graceful=False)
            raise

    def _gather(self, what: str) -> list:
        """Each rank's next reply, waiting at most timeout_s (+ start-up slack) for each."""
        results = []
        deadline = time.monotonic() + self.timeout_s + 30.0
        for rank, conn in enumerate(self._conns):
            while not conn.poll(0.2):
                # Any dead rank ends the wait: the others may be blocked on it until their timeout.
                self._raise_if_a_rank_died(what)
                if time.monotonic() > deadline:
                    raise WorkerLost(rank, f"rank {rank} did not answer {what} within {self.timeout_s:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                raise WorkerLost(rank, f"rank {rank} closed its pipe during {what}") from None
            if status == "error":
                # A peer's death often surfaces first as this rank's failed receive: name the cause.
                time.sleep(0.5)
                self._raise_if_a_rank_died(what, f"\nrank {rank} then failed with:\n{value}")
                raise RuntimeError(f"rank {rank} failed during {what}:\n{value}")
            results.append(value)
        return results

    def _raise_if_a_rank_died(self, what: str, detail: str = "") -> None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise WorkerLost(rank, f"rank {rank} exited (code {proc.exitcode}) during {what}{detail}")

    def _call(self, method: str, args_by_rank: list[tuple]) -> list:
        for conn, args in zip(self._conns, args_by_rank, strict=True):
            conn.send((method, args))
        return self._gather(method)

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        pipe = self.run_cfg.pipeline
        last_rank = (pipe.n_chunks - 1) % pipe.stages
        args = [(step, inputs_BT if rank == 0 else None, targets_BT if rank == last_rank else None, lr)
                for rank in range(pipe.stages)]
        self._eval_model = None
        return self._step_result(step, self._call("train_step", args))

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        if self._eval_model is None:
            named = {}
            for part in self._call("named_parameters", [()] * len(self._procs)):
                named.update(part)
            self._eval_model = model_from_parameters(self.run_cfg, named)
        return float(self._eval_model(inputs_BT, targets_BT))

    def save_checkpoint(self, step_dir) -> None:
        for rank, state in enumerate(self._call("checkpoint_state", [()] * len(self._procs))):
            write_rank_file(step_dir, rank, state)

    def load_checkpoint(self, step_dir) -> None:
        merged, rng_by_rank = read_checkpoint(step_dir)
        self._call("load_checkpoint_state", [(merged, rng_by_rank.get(rank)) for rank in range(len(self._procs))])
        self._eval_model = None

    def close(self) -> None:
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        """graceful: ask each live rank to leave the process group first; otherwise terminate at once."""
        if graceful:
            for conn, proc in zip(self._conns, self._procs, strict=True):
                if proc.is_alive():
                    try:
                        conn.send(("close", ()))
                    except (BrokenPipeError, OSError):
                        pass
        for proc in self._procs:
            if graceful:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None
