"""The product runs from an installed copy, without the source checkout: the package is installed by
pip (a real setuptools build of pyproject.toml, as a wheel would be) into a temporary folder, and
its console scripts run from a working directory outside the repository, with only that folder on
PYTHONPATH. `attnres-pp bench --help` lists the benchmarks users run, the simulator reads the
activation units it ships as package data, and `attnres-lab --help` shows the lab's studies. Nothing
of the checkout is imported: every child checks where attnres_pp came from. (That no module finds
the checkout by climbing from its own file is tests/test_layering.py's check; a benchmark run here
would add a minute and check nothing more about the install.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A pip install of a copy of the sources (so the build writes nothing into the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("attnres_pp", "attnres_lab"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    target = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "attnres_pp" / "simulator" / "memory_units.json").is_file(), "package data not installed"
    return target


def _run(installed: Path, workdir: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One console script of the install, run from `workdir` with only the install on PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=str(installed), OMP_NUM_THREADS="1")
    return subprocess.run([str(installed / "bin" / argv[0]), *argv[1:]], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_installed_package_runs_outside_the_checkout(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    where = subprocess.run([sys.executable, "-c", "import attnres_pp, attnres_lab; print(attnres_pp.__file__); "
                            "print(attnres_lab.__file__)"], cwd=tmp_path, env={**env, "PYTHONPATH": str(installed)},
                           capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(installed) for line in where.stdout.split()), where.stdout

    helped = _run(installed, tmp_path, "attnres-pp", "bench", "--help")
    assert helped.returncode == 0, helped.stderr
    for name in ("bubbles", "comm", "overhead", "peer", "variants", "kernels", "memory", "split", "inference",
                 "recovery", "data", "prepare"):
        assert name in helped.stdout, name
    assert "fidelity" not in helped.stdout  # a study of the lab, not a benchmark of the product

    memory = _run(installed, tmp_path, "attnres-pp", "simulate", "memory", "--schedule", "1f1b", "--stages", "2",
                  "--microbatches", "4", "--json")
    assert memory.returncode == 0, memory.stderr
    assert json.loads(memory.stdout)["memory_per_rank"][0]["activation_peak_bytes"] > 0

    lab = _run(installed, tmp_path, "attnres-lab", "--help")
    assert lab.returncode == 0, lab.stderr
    assert "fidelity" in lab.stdout and "fit-memory-units" in lab.stdout
