"""The private local Ray instance a run starts (`--launcher ray` without an address) requires
Ray's token authentication (Ray 2.60 turns it on for a new local cluster, with the user's token
in ~/.ray/auth_token): a client without a token and one with a wrong token are refused, one with
the user's token is accepted. Each probe is a real client of the instance's GCS, in its own
process; the driver runs in a process of its own too, with HOME pointing at a fresh folder (Ray
makes the token there, readable by the user only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys
    from attnres_pp.launch.ray_rank_group import RayRankGroup
    import ray

    probe = '''
    import sys
    from ray._raylet import GcsClient
    try:
        GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=10)
        print("ACCEPTED")
    except Exception as error:
        print("REFUSED", type(error).__name__)
    '''
    group = RayRankGroup(1, 60)
    gcs = ray.get_runtime_context().gcs_address
    own = os.path.join(os.environ["HOME"], ".ray", "auth_token")
    clients = {"no token": {"RAY_AUTH_MODE": "disabled"},
               "a wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
               "the user's token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": own}}
    answers = {}
    for name, env in clients.items():
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        out = subprocess.run([sys.executable, "-c", probe, gcs], capture_output=True, text=True, timeout=60,
                             env={**base, **env}).stdout.split()
        answers[name] = out[0] if out else "NO ANSWER"
    group.stop()
    print(json.dumps({"answers": answers, "gcs": gcs}))
""")


def test_the_private_instance_refuses_clients_without_the_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["answers"] == {"no token": "REFUSED", "a wrong token": "REFUSED",
                                 "the user's token": "ACCEPTED"}, report
    assert report["gcs"].startswith("127.0.0.1:")
