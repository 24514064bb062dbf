"""Ahead-of-time builds of the Triton kernels for Hopper on this CPU-only machine: a small grid of
`scripts/aot_kernels.py` must build every kernel (MSAR's fused stream kernels included) without a
spill, and an oversized tile budget must be caught as a spill. Skipped only where triton's compiler
or its bundled ptxas / cuobjdump are missing (checked without importing triton here, so the kernel
tests can still set the interpreter)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from attnres_pp.kernels import aot
from tests.cli_batch import Run, run_cli_batch
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


SMALL_GRID = ["--grid", "small", "--arch", "90"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> tuple[Run, Run, Path]:
    """The small grid (its builds written as JSON) and, after it, the same grid's phase-2 kernels at an
    oversized tile budget, run as `python scripts/aot_kernels.py ARGS` each but in one child process
    (`tests.cli_batch`: one interpreter start and torch and triton import for both). The override is
    a module setting the second run sets; the first run sees the launchers' own budget."""
    reason = _tools_missing()
    if reason:
        pytest.skip(f"cannot build kernels ahead of time: {reason}")
    out = tmp_path_factory.mktemp("aot") / "builds.json"
    small, oversized = run_cli_batch([[*SMALL_GRID, "--json", str(out)],
                                      [*SMALL_GRID, "--tile-elems", "65536", "--ops", "phase2"]],
                                     timeout_s=600, script=SCRIPT, unset=("TRITON_INTERPRET",))
    return small, oversized, out


@pytest.mark.subprocess
@pytest.mark.xdist_group("aot-kernels")  # one worker builds `builds` once
@pytest.mark.timeout(600)  # both runs in this test's set-up: 300 s each, as when each test ran its own
def test_small_grid_builds_every_kernel_for_hopper_without_spills(builds):
    result, _oversized, out = builds
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["builds"]
    assert {b["kernel"] for b in rows} == KERNELS
    for b in rows:
        assert b["arch"] == 90 and not b["spills"] and b["stack"] == 0 and b["local"] == 0
        assert 0 < b["registers"] <= 65536 // (32 * b["num_warps"])
        assert 0 < b["occupancy"] <= 1
    assert "0 spill" in result.stdout


@pytest.mark.subprocess
@pytest.mark.xdist_group("aot-kernels")
@pytest.mark.timeout(600)
def test_an_oversized_tile_budget_is_reported_as_a_spill(builds):
    # One kernel family is enough to reach the spill check, which reads every build's ptxas report alike.
    _small, result, _out = builds
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
