"""The control channel of `--launcher torchrun` (`torchrun_rank_group`): what torchrun tells each
process (`TorchrunEnv`), one authenticated TCP connection from every rank to rank 0, and the thread
that runs a rank's worker calls while its main thread watches that connection.

Rank 0 listens on its address on the route to MASTER_ADDR (loopback under `torchrun --standalone`)
and publishes that address in torchrun's rendezvous store at MASTER_ADDR:MASTER_PORT; each other
rank reads it there and connects. The channel carries pickles, so it takes only the job's own
ranks, the trust boundary of the local launcher's pipes: rank 0 puts a fresh random key in the
rendezvous store, which torch.distributed already trusts to hold the job together, and every
connection proves both ends know that key (an HMAC challenge each way, with short reads of at most
128 bytes) before anything on it is unpickled.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import NoReturn

from attnres_pp.launch.storage_fault import failure_reply

SLACK_S = 30.0  # start-up slack on every wait, as the other rank groups give


@dataclass(frozen=True, kw_only=True)
class TorchrunEnv:
    """What torchrun tells each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    agent_store: bool = True  # the store at MASTER_ADDR:MASTER_PORT is the agent's (else rank 0 hosts it)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"torchrun's RANK={self.rank}, WORLD_SIZE={self.world_size}, LOCAL_RANK={self.local_rank} "
                             f"and LOCAL_WORLD_SIZE={self.local_world_size} are inconsistent: start the processes "
                             "with torchrun")
        if not 0 < self.master_port < 2**16:
            raise ValueError(f"torchrun's MASTER_PORT={self.master_port} is not a TCP port: start the processes "
                             "with torchrun")

    @classmethod
    def from_environ(cls, environ=None) -> TorchrunEnv | None:
        """This process's torchrun settings, or None when torchrun did not start it."""
        env = os.environ if environ is None else environ
        names = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if any(name not in env for name in names):
            return None
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   local_rank=int(env.get("LOCAL_RANK", 0)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                   master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    def refusal(self, pipe) -> str | None:
        """Why a run of PipelineConfig `pipe` cannot run in these processes, or None."""
        if pipe.launcher != "torchrun":
            if self.world_size == 1:
                return None
            return (f"torchrun started {self.world_size} processes, and each would run the whole --launcher "
                    f"{pipe.launcher} run: give --launcher torchrun (each process then is one rank)")
        if self.world_size != pipe.world_size:
            layout = f"--data-parallel {pipe.data_parallel} x --stages {pipe.stages} x --tensor-parallel " \
                     f"{pipe.tensor_parallel} = {pipe.world_size} ranks"
            return (f"--launcher torchrun: torchrun started {self.world_size} processes (WORLD_SIZE) but {layout}: "
                    f"start {pipe.world_size} in all (torchrun --nproc-per-node x --nnodes), or give flags whose "
                    f"product is {self.world_size}")
        return None


def _store(env: TorchrunEnv, timeout_s: float, *, master: bool):
    """A client of the job's rendezvous store, or on rank 0 without the agent's store its server
    (multi-tenant: the mesh's env:// rendezvous in this process then shares it)."""
    from torch.distributed import TCPStore

    return TCPStore(env.master_addr, env.master_port, env.world_size, master and not env.agent_store,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)


def _keys(env: TorchrunEnv) -> tuple[str, str]:
    prefix = f"attnres_pp/control/{env.restart_count}/"  # a torchrun restart starts a fresh channel
    return prefix + "address", prefix + "key"


def _route_address(host: str, port: int) -> str:
    """This machine's IPv4 address on the route to `host` (no packet is sent)."""
    target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _digest(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_short(conn: Connection, deadline: float, limit: int = 128) -> bytes:
    """One message of at most `limit` bytes (before authentication nothing longer is read)."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("no answer")
    return conn.recv_bytes(limit)


class ControlError(ValueError):
    """The control channel could not be set up: one line saying why (a ValueError, so the CLI prints it
    as `error:`, as the Ray launcher does a rendezvous that cannot connect)."""


class DriverEnded(Exception):
    """Rank 0 ended before it started the ranks (a refusal, a finished run; its own line says why)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"rank 0 ended with exit code {code}")
        self.code = code


def open_driver_channel(env: TorchrunEnv, timeout_s: float) -> dict[int, Connection]:
    """Rank 0: listen, publish the address and a fresh key, and accept one authenticated connection
    from every other rank within the timeout; returns them by rank."""
    store = _store(env, timeout_s + SLACK_S, master=True)
    key = secrets.token_bytes(32)
    host = _route_address(env.master_addr, env.master_port)
    server = socket.create_server((host, 0))
    conns: dict[int, Connection] = {}
    try:
        address_key, key_key = _keys(env)
        store.set(key_key, key)
        store.set(address_key, f"{host}:{server.getsockname()[1]}")
        deadline = time.monotonic() + timeout_s + SLACK_S
        while len(conns) < env.world_size - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, env.world_size)) - set(conns))
                raise ControlError(f"ranks {missing} did not connect to rank 0 at {host} within "
                                   f"{timeout_s + SLACK_S:.0f} s") from None
            sock.setblocking(True)
            conn = Connection(sock.detach())
            rank = _accept_rank(conn, key, env.world_size, min(deadline, time.monotonic() + 10.0))
            if rank is None or rank in conns:
                conn.close()  # not one of the job's ranks (or a second answer for one): ignored
                continue
            conns[rank] = conn
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    finally:
        server.close()
    return conns


def _accept_rank(conn: Connection, key: bytes, world_size: int, deadline: float) -> int | None:
    """The rank a new connection proves it is one of the job's (None if it cannot), after proving
    rank 0's own knowledge of the key in return."""
    try:
        challenge = secrets.token_bytes(32)
        conn.send_bytes(challenge)
        answer = _recv_short(conn, deadline)
        digest, their_challenge, rank_bytes = answer[:32], answer[32:64], answer[64:]
        if len(rank_bytes) != 4 or not hmac.compare_digest(digest, _digest(key, b"rank", challenge, rank_bytes)):
            return None
        conn.send_bytes(_digest(key, b"driver", their_challenge))
    except (OSError, EOFError, TimeoutError):
        return None
    rank = int.from_bytes(rank_bytes, "big")
    return rank if 0 < rank < world_size else None


def connect_to_driver(env: TorchrunEnv, timeout_s: float) -> Connection:
    """Rank > 0: rank 0's address and key from the store, then an authenticated connection."""
    store = _store(env, timeout_s + SLACK_S, master=False)
    address_key, key_key = _keys(env)
    try:
        store.wait([address_key], datetime.timedelta(seconds=timeout_s + SLACK_S))
    except Exception:  # torch's DistStoreError (a RuntimeError) or its timeout
        raise ControlError(f"rank 0 did not open the control channel within {timeout_s + SLACK_S:.0f} s") from None
    address = store.get(address_key).decode()
    if address.startswith("exit "):  # rank 0 ended before it started any rank (its own line says why)
        raise DriverEnded(int(address.split()[1]))
    key = store.get(key_key)
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s + SLACK_S
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        sock.setblocking(True)  # Connection reads the bare descriptor, which must block
        conn = Connection(sock.detach())
        challenge = _recv_short(conn, deadline)
        mine, rank_bytes = secrets.token_bytes(32), env.rank.to_bytes(4, "big")
        conn.send_bytes(_digest(key, b"rank", challenge, rank_bytes) + mine + rank_bytes)
        if not hmac.compare_digest(_recv_short(conn, deadline), _digest(key, b"driver", mine)):
            raise ControlError(f"the process at {address} is not this job's rank 0 (it does not know the key)")
    except (OSError, EOFError, TimeoutError) as error:
        raise ControlError(f"could not connect to rank 0 at {address}: {error}") from None
    return conn


def note_early_exit(env: TorchrunEnv, code: int, timeout_s: float) -> None:
    """Rank 0 ended without starting the ranks (a refusal, a finished run): the others leave with its code."""
    try:
        store = _store(env, timeout_s, master=True)
        address_key, _ = _keys(env)
        if not store.check([address_key]):
            store.set(address_key, f"exit {code}")
    except Exception:  # noqa: BLE001  (the store is gone: torchrun's agent stops the others)
        pass


# ---- one rank's calls on a thread of their own ----

class WorkerThread:
    """Runs this rank's worker calls, one at a time, on a daemon thread, so the main thread stays free
    to watch the control channel (a call may block on a lost peer until gloo's own timeout). `done`
    becomes readable (`multiprocessing.connection.wait`) when the call has finished; `take()` then
    returns its reply: ("ok", value), ("refused", one line), ("fault", a StorageFault) or ("error",
    traceback), the messages of the local launcher's ranks."""

    def __init__(self, name: str) -> None:
        self.worker = None
        self.done, self._done_writer = Pipe(duplex=False)
        self._job: tuple[str, tuple] | None = None
        self._reply: tuple | None = None
        self._ready = threading.Condition()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, method: str, args: tuple) -> None:
        with self._ready:
            self._job = (method, args)
            self._ready.notify()

    def take(self) -> tuple:
        """The finished call's reply (once `done` is readable; blocks until then)."""
        self.done.recv_bytes()
        reply, self._reply = self._reply, None
        return reply

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._job is not None)
                (method, args), self._job = self._job, None
            self._reply = self._run(method, args)
            self._done_writer.send_bytes(b"")

    def _run(self, method: str, args: tuple) -> tuple:
        try:
            if method == "start":  # (worker_cls, kwargs, init_method, world_size)
                worker_cls, kwargs, init_method, world_size = args
                self.worker = worker_cls(**kwargs)
                return "ok", self.worker.join_process_group(init_method, world_size)
            return "ok", getattr(self.worker, method)(*args)
        except ValueError as error:
            if method == "start":  # a setting or resource this rank refuses, said in one line
                return "refused", " ".join(str(error).split())
            return "error", traceback.format_exc()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001  DCP's CheckpointException is a BaseException
            return failure_reply(error, traceback.format_exc)  # a full disk: ("fault", ...), rank 0 says it once


def exit_now(code: int) -> NoReturn:
    """End this process at once: its worker thread may be blocked on a lost peer, and a normal exit
    would wait for it in the process group's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
