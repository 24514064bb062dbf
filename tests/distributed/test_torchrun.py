"""`--launcher torchrun`: `torchrun --standalone --nproc-per-node N -m attnres_pp train --launcher
torchrun` trains with the local launcher's losses (D = 2 x P = 2 with tied embeddings, also P = 1's),
rank 0 alone writing the driver's files and every rank its checkpoint shard; a
rank killed mid-run (one > 0, and rank 0) ends every process within the timeout with one `error:` line
naming it and no traceback, and so does a cancelled job (SIGTERM to torchrun); a WORLD_SIZE that is not
D x P x T, and the combinations torchrun cannot carry, are one line each.

torchrun's own agent prints its report of a failed child (a traceback of its own) on its stderr;
each rank's output is read from the files `--redirects 3 --log-dir` writes, one folder per rank."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from attnres_lab.chaos_probe import children
from attnres_pp.cli import main
from attnres_pp.launch.torchrun_channel import TorchrunEnv, _accept_rank, _digest
from attnres_pp.launch.torchrun_rank_group import check_torchrun_run
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train.shards import checkpoint_tensors
from tests.run_helpers import assert_same_losses, losses

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--microbatches", "2", "--eval-every", "0", "--threads", "1", "--quiet"]
TIMEOUT_S = 20  # --timeout of the runs stopped mid-run
FAKE_ENV = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _torchrun(nproc: int, argv: list[str], log_dir: Path) -> subprocess.Popen:
    """`torchrun --standalone` (as `python -m torch.distributed.run`: the script need not be on PATH)
    of `attnres_pp train --launcher torchrun argv`, each rank's output in its own files under log_dir."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--log-dir", str(log_dir), "--redirects", "3", "-m", "attnres_pp", "train", "--launcher", "torchrun",
               *argv]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rank_logs(log_dir: Path, stream: str = "stderr") -> dict[int, str]:
    """Each local rank's `stream` as torchrun's --redirects wrote it."""
    return {int(path.parent.name): path.read_text() for path in log_dir.glob(f"*/attempt_*/*/{stream}.log")}


def _rank_pids(agent_pid: int, nproc: int, deadline_s: float = 60.0) -> dict[int, int]:
    """{RANK: pid} of the processes torchrun's agent started (its children, by their environment)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = {}
        for pid in children(agent_pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((item[5:] for item in environ if item.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = pid
        if len(found) == nproc:
            return found
        time.sleep(0.2)
    raise AssertionError(f"torchrun's agent (pid {agent_pid}) did not start {nproc} ranks within {deadline_s:.0f} s")


def _running(pids) -> list[int]:
    """The pids still running (zombies waiting for their parent count as ended)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not end within {timeout_s:.0f} s:\n{err[-3000:]}") from None


@pytest.mark.distributed
def test_torchrun_trains_with_the_local_launchers_losses(tmp_path):
    """Each torchrun process is one rank of the same mesh, so the losses are the other launchers' bit
    for bit (the in-process launcher's here: the same ranks as threads, the same sums in the same
    order, so the local launcher's rank processes' too); rank 0 writes summary.json and metrics.jsonl,
    every rank its checkpoint shard. One job of D = 2 replicas of P = 2 stages carries the pp hops, the
    dp gradient sums and the tied embeddings between torchrun's processes: each stage holds a copy,
    summed by the embedding group (each replica's pp group), and the checkpoint holds the one matrix once."""
    argv = [*SMALL, "--stages", "2", "--data-parallel", "2", "--tie-embeddings", "--steps", "3"]
    assert main(["train", "--launcher", "inprocess", *argv, "--out", str(tmp_path / "local")]) == 0
    proc = _torchrun(4, [*argv, "--out", str(tmp_path / "torchrun")], tmp_path / "logs")
    _, err = _finish(proc, 300)
    logs = _rank_logs(tmp_path / "logs")
    assert proc.returncode == 0, f"{err[-3000:]}\n{logs}"
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    run = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert len(run["losses"]) == 3
    assert run["losses"] == local["losses"] and run["val_loss"] == local["val_loss"]
    assert run["config"]["pipeline"]["launcher"] == "torchrun"
    assert len((tmp_path / "torchrun" / "metrics.jsonl").read_text().splitlines()) == 3
    # The files the local launcher's ranks write: one shard per rank (DCP's `__RANK_0.distcp`, so each
    # rank wrote its own), DCP's .metadata and one meta.json.
    final = Path(run["final_checkpoint"])
    assert final.parent.parent == (tmp_path / "torchrun").resolve()
    assert sorted(p.name for p in final.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.json"]
    # P = 1's losses too: one matrix where the stages keep two
    assert main(["train", *argv, "--stages", "1", "--launcher", "inprocess", "--out", str(tmp_path / "one")]) == 0
    assert_same_losses(run["losses"], losses(tmp_path / "one"))
    saved = checkpoint_tensors(final)
    assert "embed.tok.weight" in saved and not [key for key in saved if "lm_head" in key]
    assert sorted(logs) == [0, 1, 2, 3] and not any(text.strip() for text in logs.values()), logs


def _stop_mid_run(tmp_path: Path, stop) -> tuple[float, str, dict[int, str]]:
    """A long P = 2 run, `stop(agent pid, {rank: pid})` once its first step is done: (seconds until
    torchrun ended, torchrun's own stderr, each rank's stderr), every rank's process checked gone."""
    out = tmp_path / "run"
    proc = _torchrun(2, [*SMALL, "--stages", "2", "--steps", "100000", "--timeout", str(TIMEOUT_S),
                         "--out", str(out)], tmp_path / "logs")
    try:
        pids = _rank_pids(proc.pid, 2)
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, _rank_logs(tmp_path / "logs")
            time.sleep(0.1)
        stop(proc.pid, pids)
        stopped_at = time.monotonic()
        _, err = _finish(proc, TIMEOUT_S + 20)
        took_s = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    time.sleep(0.5)
    assert not _running(pids.values())
    logs = _rank_logs(tmp_path / "logs")
    assert "Traceback" not in "".join(logs.values()), logs
    return took_s, err, logs


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_every_rank_with_one_line_naming_it(tmp_path, victim):
    """SIGKILL one rank mid-run: every process ends well within --timeout, and the ranks' output is
    one `error:` line naming the lost rank (rank 0 names rank 1; rank 1 names a lost rank 0)."""
    took_s, err, logs = _stop_mid_run(tmp_path, lambda agent, pids: os.kill(pids[victim], signal.SIGKILL))
    assert took_s < TIMEOUT_S, f"the ranks took {took_s:.1f} s to end"
    # torchrun's report of its failed children: the survivor's exit code 1 (exit_now's), the victim's -9
    for rank, code in ((1 - victim, "1"), (victim, "-9")):
        assert re.search(rf"rank\s+: {rank} \(local_rank: {rank}\)\s+exitcode\s+: {code} ", err), err[-3000:]
    lines = [line for text in logs.values() for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, logs
    label = f"rank {victim} (dp 0, pp {victim})"
    assert lines[0].startswith("error: ") and label in lines[0] and "ended" in lines[0], lines
    assert logs[victim] == ""  # what named it is the survivor


@pytest.mark.distributed
def test_a_cancelled_job_ends_every_rank_with_one_line(tmp_path):
    """SIGTERM to torchrun (a cancelled job): its agent stops the ranks with SIGTERM, rank 0 says so
    in one line, the others end quietly, all within --timeout."""
    took_s, _, logs = _stop_mid_run(tmp_path, lambda agent, pids: os.kill(agent, signal.SIGTERM))
    assert took_s < TIMEOUT_S, f"the ranks took {took_s:.1f} s to end"
    lines = [line for text in logs.values() for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 was stopped by SIGTERM during "), logs
    assert logs[1] == ""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_world_size_that_is_not_the_mesh_is_one_error_line(tmp_path, monkeypatch, capfd, rank):
    """Each of torchrun's 2 processes (its environment, here in this process) given a 4-rank layout:
    rank 0 says so in one line, notes its exit in the job's store (the others may be waiting for its
    channel) and ends with exit code 2 at once (`exit_now`, os._exit in a rank: here an exception);
    rank 1 ends quietly with the same code; nothing is written. torchrun's report of a rank's exit
    code is in the killed-rank runs above."""
    from attnres_pp.launch import torchrun_rank_group

    with socket.socket() as probe:  # a free port for rank 0's store (the agent's is not there)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {**FAKE_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)

    def exit_now(code):
        raise SystemExit(code)

    noted, note = [], torchrun_rank_group.note_early_exit
    monkeypatch.setattr(torchrun_rank_group, "exit_now", exit_now)
    monkeypatch.setattr(torchrun_rank_group, "note_early_exit",
                        lambda env, code, timeout_s: (noted.append(code), note(env, code, timeout_s)))
    argv = ["train", "--launcher", "torchrun", *SMALL, "--stages", "4", "--steps", "1", "--out", str(tmp_path / "run")]
    if rank == 0:
        with pytest.raises(SystemExit) as ended:
            main(argv)
        code = ended.value.code
    else:
        code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2
    lines = [line for line in (out + err).splitlines() if line.strip()]
    if rank == 0:
        assert len(lines) == 1 and lines[0].startswith("error: --launcher torchrun: torchrun started 2 processes")
        assert "= 4 ranks" in lines[0] and "--nproc-per-node" in lines[0]
    else:
        assert lines == []
    assert noted == ([2] if rank == 0 else [])  # only rank 0 holds the channel the others wait for
    assert not (tmp_path / "run").exists()


def test_the_torchrun_launcher_outside_torchrun_is_one_error_line(tmp_path, monkeypatch, capsys):
    for name in FAKE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--launcher", "torchrun", *SMALL, "--stages", "2", "--steps", "1",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --launcher torchrun runs in the processes torchrun starts")
    assert "torchrun --standalone --nproc-per-node N -m attnres_pp train --launcher torchrun" in err[0]


def test_what_torchrun_cannot_carry_is_refused_with_the_fix():
    """The layout must be WORLD_SIZE's, replica groups cannot restart inside a torchrun job, and
    torchrun's processes cannot each run a whole run of another launcher."""
    env = TorchrunEnv.from_environ(FAKE_ENV)
    assert (env.rank, env.world_size, env.master_port, env.agent_store) == (0, 2, 29500, False)
    assert TorchrunEnv.from_environ({}) is None
    assert env.refusal(PipelineConfig(launcher="torchrun", stages=2)) is None
    assert env.refusal(PipelineConfig(launcher="torchrun", data_parallel=2)) is None
    wrong = env.refusal(PipelineConfig(launcher="torchrun", stages=2, tensor_parallel=2))
    assert "torchrun started 2 processes (WORLD_SIZE)" in wrong and "x --tensor-parallel 2 = 4 ranks" in wrong
    assert "give --launcher torchrun" in env.refusal(PipelineConfig(launcher="local", stages=2))
    alone = TorchrunEnv.from_environ({**FAKE_ENV, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    assert alone.refusal(PipelineConfig(launcher="local")) is None  # one process runs the run as asked
    with pytest.raises(ValueError, match="--fault-tolerance replicas does not run under --launcher torchrun"):
        check_torchrun_run(PipelineConfig(launcher="torchrun", data_parallel=2), fault_tolerance="replicas",
                           environ=FAKE_ENV)
    with pytest.raises(ValueError, match="= 4 ranks"):
        check_torchrun_run(PipelineConfig(launcher="torchrun", stages=4), fault_tolerance="off", environ=FAKE_ENV)


def test_generate_refuses_the_torchrun_launcher_in_one_line(tmp_path, capsys):
    assert main(["generate", "--resume", str(tmp_path), "--prompt", "x", "--max-new-tokens", "1",
                 "--launcher", "torchrun"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --launcher torchrun runs `attnres-pp train` only: generate with --launcher local, ray, "
                   "inprocess"]


def _handshake(server_key: bytes, client_key: bytes, rank: int, answer: bytes | None = None):
    """rank 0's side of a new control connection (`_accept_rank`) against a client holding
    `client_key` that claims `rank` (or sends `answer` instead): (the rank accepted, rank 0's proof)."""
    a, b = socket.socketpair()
    server, client = Connection(a.detach()), Connection(b.detach())
    accepted: dict = {}
    thread = threading.Thread(target=lambda: accepted.update(rank=_accept_rank(server, server_key, 2,
                                                                                time.monotonic() + 5.0)))
    thread.start()
    challenge, mine, rank_bytes = client.recv_bytes(64), b"m" * 32, rank.to_bytes(4, "big")
    client.send_bytes(answer if answer is not None else
                      _digest(client_key, b"rank", challenge, rank_bytes) + mine + rank_bytes)
    thread.join(10.0)
    proof = client.recv_bytes(64) if accepted["rank"] is not None else None
    server.close()
    client.close()
    return accepted["rank"], proof


def test_the_control_channel_takes_only_the_jobs_ranks():
    """A connection is accepted only with an answer keyed by the job's key, for a rank of the job;
    rank 0 then proves it holds the key too. A pickle in place of the answer is never unpickled."""
    key = b"k" * 32
    assert _handshake(key, key, 1) == (1, _digest(key, b"driver", b"m" * 32))
    assert _handshake(key, b"x" * 32, 1) == (None, None)
    assert _handshake(key, key, 2) == (None, None)  # WORLD_SIZE is 2
    assert _handshake(key, key, 1, answer=pickle.dumps(AssertionError("unpickled"))) == (None, None)
    assert _handshake(key, key, 1, answer=b"z" * 4096) == (None, None)  # longer than an answer: not read
