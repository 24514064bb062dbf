"""The private local Ray instance a run starts (`--launcher ray` without an address) accepts only
a token of its own: not a client without one, not one with a wrong token, and not one holding the
user's shared ~/.ray/auth_token (which Ray would otherwise use, and which every `ray start`
cluster of the user accepts). Each probe is a real client of the instance's GCS, in its own
process; the driver runs in a process of its own too, with HOME pointing at a folder where a
shared token is planted first. Afterwards the driver's RAY_AUTH_* settings are as before and the
token's folder is gone."""

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

REPO = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys
    from attnres_pp.pipeline.ray_rank_group import RayRankGroup
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
    own = os.environ["RAY_AUTH_TOKEN_PATH"]
    folder = os.path.dirname(own)
    shared = os.path.join(os.environ["HOME"], ".ray", "auth_token")
    clients = {"no token": {"RAY_AUTH_MODE": "disabled"},
               "the user's shared token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": shared},
               "a wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
               "the instance's own token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": own}}
    answers = {}
    for name, env in clients.items():
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        out = subprocess.run([sys.executable, "-c", probe, gcs], capture_output=True, text=True, timeout=60,
                             env={**base, **env}).stdout.split()
        answers[name] = out[0] if out else "NO ANSWER"
    mode = oct(os.stat(own).st_mode & 0o777), oct(os.stat(folder).st_mode & 0o777)
    group.stop()
    print(json.dumps({"answers": answers, "modes": mode, "gcs": gcs, "folder_left": os.path.exists(folder),
                      "after": {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}}))
""")


def test_the_private_instance_accepts_only_its_own_token(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("f" * 64)  # the user's shared token, planted first
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["answers"] == {"no token": "REFUSED", "the user's shared token": "REFUSED",
                                 "a wrong token": "REFUSED", "the instance's own token": "ACCEPTED"}, report
    assert report["gcs"].startswith("127.0.0.1:")
    assert report["modes"] == ["0o600", "0o700"]
    assert not report["folder_left"]
    assert report["after"] == {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN_PATH": None}
