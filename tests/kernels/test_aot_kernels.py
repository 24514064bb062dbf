"""Ahead-of-time builds of the Triton kernels for Hopper on this CPU-only machine: a small grid of
`scripts/aot_kernels.py` must build every kernel (MSAR's fused stream kernels included) without a
spill, and an oversized tile budget must be caught as a spill. Skipped only where triton's compiler
or its bundled ptxas / cuobjdump are missing (checked without importing triton here, so the kernel
tests can still set the interpreter)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_pp.kernels import aot
from tests.run_helpers import REPO

SCRIPT = REPO / "scripts" / "aot_kernels.py"
KERNELS = {"scores_kernel", "phase1_fwd_kernel", "phase1_bwd_kernel", "key_grad_kernel", "phase2_fwd_kernel",
           "phase2_bwd_kernel", "streams_fwd_kernel", "streams_dp_kernel", "streams_du_kernel", "streams_dv_kernel",
           "streams_dtaps_kernel"}  # fmt: skip


def _tools_missing() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return "triton is not installed"
    bin_dir = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    missing = [name for name in ("ptxas", "cuobjdump") if not os.access(bin_dir / name, os.X_OK)]
    return f"triton bundles no {', '.join(missing)}" if missing else None


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def tools():
    reason = _tools_missing()
    if reason:
        pytest.skip(f"cannot build kernels ahead of time: {reason}")


@pytest.mark.subprocess
def test_small_grid_builds_every_kernel_for_hopper_without_spills(tools, tmp_path):
    out = tmp_path / "builds.json"
    result = _run("--grid", "small", "--arch", "90", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    builds = json.loads(out.read_text())["builds"]
    assert {b["kernel"] for b in builds} == KERNELS
    for b in builds:
        assert b["arch"] == 90 and not b["spills"] and b["stack"] == 0 and b["local"] == 0
        assert 0 < b["registers"] <= 65536 // (32 * b["num_warps"])
        assert 0 < b["occupancy"] <= 1
    assert "0 spill" in result.stdout


@pytest.mark.subprocess
def test_an_oversized_tile_budget_is_reported_as_a_spill(tools):
    # One kernel family is enough to reach the spill check, which reads every build's ptxas report alike.
    result = _run("--grid", "small", "--arch", "90", "--tile-elems", "65536", "--ops", "phase2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "SPILL" in result.stdout and "spill registers" in result.stderr


def test_resource_usage_and_occupancy_arithmetic():
    text = (
        " Function _phase1_fwd_kernel:\n  REG:90 STACK:0 SHARED:16384 LOCAL:0 CONSTANT[0]:664\n"
        " Function _key_grad_kernel:\n  REG:128 STACK:104 SHARED:8192 LOCAL:8 TEXTURE:0\n"
    )
    usage = aot.parse_resource_usage(text)
    assert usage["_phase1_fwd_kernel"] == {"REG": 90, "STACK": 0, "SHARED": 16384, "LOCAL": 0}
    assert usage["_key_grad_kernel"]["STACK"] == 104 and usage["_key_grad_kernel"]["LOCAL"] == 8
    assert aot.occupancy(128, 16384, 16, 90) == 0.25  # 16 warps x 128 registers fill the register file
    assert aot.occupancy(64, 8192, 16, 90) == 0.5
    assert aot.occupancy(32, 0, 4, 90) == 1.0
    assert aot.occupancy(32, 200_000, 4, 90) == 4 / 64  # shared memory: one block
    assert aot.occupancy(32, 100_000, 4, 80) == 4 / 64  # sm_80 has 164 KiB per SM
