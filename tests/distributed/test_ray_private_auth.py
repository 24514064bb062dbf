"""The private local Ray instance a run starts (`attnres-pp train --launcher ray` without an
address): it requires Ray's token authentication (Ray 2.60 turns it on for a new local cluster,
with the user's token in ~/.ray/auth_token), and Ctrl-C stops it with the actors. One run serves
both, so the instance is started once: while it trains, a client without a token and one with a
wrong token are refused, one with the user's token is accepted (each probe a real client of the
instance's GCS, outside the run: the one without a token in a process of its own, the two with a
token in another; the run's HOME is a fresh folder, where Ray makes the token, readable by the
user only); the instance's node is loopback, and so its actors' gloo (`lo`), each
actor's lines labelled with its rank and place in the mesh; then SIGINT to its process group, as a
terminal sends it, ends the command with 130 and every process it started (Ray's and the actors).
(The logical CPU per rank a private instance offers on a smaller machine: test_ray.py, in-process.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "attnres_pp.cli"]
TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--stages", "2", "--virtual", "2", "--eval-every", "3"]

# A client of the GCS at argv[1] for each token argument in turn ("-": the user's, from RAY_AUTH_TOKEN_PATH;
# otherwise the token itself), printing what it hears. Ray reads RAY_AUTH_MODE when it is imported, the
# token when a client first needs it: the cache is reset before each client, so that clients with
# different tokens share one process (one import of Ray).
PROBE = textwrap.dedent("""
    import os
    import sys
    from ray._raylet import AuthenticationTokenLoader, GcsClient
    path = os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    for token in sys.argv[2:]:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        if token == "-":
            os.environ["RAY_AUTH_TOKEN_PATH"] = path
        elif token:
            os.environ["RAY_AUTH_TOKEN"] = token
        AuthenticationTokenLoader.instance().reset_cache()
        try:
            GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=10)
            print("ACCEPTED", flush=True)
        except Exception as error:
            print("REFUSED", type(error).__name__, flush=True)
""")


def test_the_private_instance_refuses_clients_without_the_token_and_ctrl_c_stops_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # Each rank sleeps 1 s before every step (attnres_pp.train.faults' pacing; no number changes): the
    # probes and the Ctrl-C meet a run mid-training, without the actors' compute burning the CPU meanwhile.
    env["ATTNRES_PP_SLOW_STEP_S"] = "1"
    env["RAY_DEDUP_LOGS"] = "0"  # each actor's set-up line, though the two differ only in numbers
    proc = subprocess.Popen([*CLI, "train", *TINY, "--steps", "5000", "--out", str(tmp_path / "run")],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("step") and line.split()[1].startswith("2/") for line in list(lines)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        started = _descendants(proc.pid)
        assert len(started) >= 3, started  # Ray's own processes and the two actors
        addresses = {flag.split("=", 1)[1] for pid in started for flag in _cmdline(pid)
                     if flag.startswith("--gcs-address=")}  # as Ray's own processes are told it
        assert len(addresses) == 1, addresses
        [gcs] = addresses
        assert gcs.startswith("127.0.0.1:"), gcs  # the instance is the machine's alone
        assert _probe_answers(gcs, env, home) == {"no token": "REFUSED", "a wrong token": "REFUSED",
                                                  "the user's token": "ACCEPTED"}
        os.killpg(proc.pid, signal.SIGINT)
        try:  # a hang guard, not a timing check
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the interrupted command did not exit:\n" + "".join(lines)[-3000:]) from None
        assert code == 130, "".join(lines)[-3000:]
        reader.join(timeout=30)
        output = "".join(lines)
        # The ranks' set-up lines, as Ray prefixes them with each actor's label: node and gloo on loopback.
        assert "StageActor rank=1 (dp 0, pp 1)" in output and ", node 127.0.0.1 (" in output, output[-3000:]
        assert ", lo), gloo group of 2 via tcp://127.0.0.1:" in output, output[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while (left := [pid for pid in started if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the command: {left}"


def _probe_answers(gcs: str, env: dict, home: Path) -> dict[str, str]:
    """What a client of the GCS at `gcs` hears with no token, a wrong one and the run's user's one (the
    last two clients in one process, token authentication on there, the user's token last: a cache
    that kept the wrong one would refuse it)."""
    clients = {"no token": ({"RAY_AUTH_MODE": "disabled"}, [""]),
               "a wrong token, the user's token": ({"RAY_AUTH_MODE": "token",
                                                    "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")},
                                                   ["0" * 64, "-"])}
    answers = {}
    for names, (auth, tokens) in clients.items():
        out = subprocess.run([sys.executable, "-c", PROBE, gcs, *tokens], capture_output=True, text=True,
                             timeout=60 * len(tokens), env={**env, **auth}).stdout.split("\n")
        heard = [line.split()[0] if line.split() else "NO ANSWER" for line in out]
        answers.update(zip(names.split(", "), (heard + ["NO ANSWER"] * len(tokens))[:len(tokens)], strict=True))
    return answers


def _as_from_a_terminal() -> None:
    """SIGINT handled by default, as in a shell: a pytest-xdist worker ignores it, and an ignored
    signal stays ignored across exec (Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
