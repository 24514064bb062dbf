# Set-up and the entry points of the README: `make demo` (train the default model), `make test` (the
# CI suite) and `make test-fast` (the inner loop: the tests that start no process of their own).
# torch is pinned to the CPU build that these machines hold on disk; an unpinned torch would pull a
# multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
# pyproject.toml's: Triton is installed beside torch, by the same pip (`make install`).
TRITON_SPEC := triton>=3.0; platform_system == 'Linux'
PYTEST_WORKERS ?= 2

.PHONY: install lock demo test test-fast lint

# pip first: the pip a fresh Python 3.11 virtualenv brings (23.2) spent 2/3 of the install's CPU
# matching every wheel listed on the index pages against this machine's tags; pip 26 resolves the
# same set in a fraction of it. Then two pips at once, one per core: one resolves torch and Triton
# with their dependencies (~1.7 GB of wheels), the other installs requirements/dev.lock, the exact
# versions of everything else `.[dev]` needs, with --no-deps (nothing to resolve; `make lock` writes
# it, tests/repo/test_dev_lock.py holds it to pyproject.toml). The package itself last, --no-deps,
# and `pip check` holds the environment to every package's requirements. --no-compile: pip would
# byte-compile every module of every package (~40 CPU-s, torch's and Triton's thousands of files);
# the interpreter compiles what is imported, on first import, and keeps it (~10 CPU-s for what the
# suite imports). docs/testing.md#timings has the figures. The lock is this machine's resolution
# (Linux, CPython 3.11); elsewhere `pip install -e ".[dev]"` resolves for the platform.
install:
	$(PIP) install --quiet "pip>=26"
	$(PIP) install --quiet --no-compile "$(TORCH_SPEC)" "$(TRITON_SPEC)" & first=$$!; \
	  $(PIP) install --quiet --no-compile --no-deps -r requirements/dev.lock; second=$$?; \
	  wait $$first && test $$second -eq 0
	$(PIP) install --quiet --no-compile --no-deps -e .
	$(PIP) check

# requirements/dev.lock from pip's resolution of `$(TORCH_SPEC) .[dev]` (scripts/lock_dev.py).
lock:
	$(PYTHON) scripts/lock_dev.py "$(TORCH_SPEC)" "$(TRITON_SPEC)"

# The demo run is rewritten each time: a fresh run refuses a folder holding another run's
# checkpoints (it would otherwise load them on a restart). Continue one with --resume instead.
demo: install
	rm -rf runs/demo
	attnres-pp train --out runs/demo

# loadgroup: the tests sharing a several-host cluster (an xdist_group) run on one worker, the rest
# one by one wherever a worker is free; tests/conftest.py hands the long ones out first.
test: install
	bash scripts/run_tests.sh -n $(PYTEST_WORKERS) --dist loadgroup

# No install (an installed checkout), and no test that starts a process: what tests/conftest.py's
# PROCESS_MARKERS mark is deselected, and an unmarked test that starts a process fails; nor the
# long tail of an in-process parity matrix (`matrix`: its P = 1 and float64 cases stay); nor the
# in-process tests of ~0.3 CPU-s or more (`heavy`: tests/heavy_tests.txt, each module keeping its
# cheapest test; scripts/heavy_tests.py reads this line to know the fast tier).
FAST_MARKERS := not multihost and not ray and not distributed and not subprocess and not matrix and not heavy
test-fast:
	bash scripts/run_tests.sh -q -n $(PYTEST_WORKERS) -m "$(FAST_MARKERS)"

lint:
	ruff check .
