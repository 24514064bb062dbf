# Set-up and the entry points of the README: `make demo` (train the default model), `make test` (the
# CI suite) and `make test-fast` (the inner loop: the tests that start no process of their own).
# torch is pinned to the CPU build that these machines hold on disk; an unpinned torch would pull a
# multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install demo test test-fast lint

# pip first: the pip a fresh Python 3.11 virtualenv brings (23.2) spent 2/3 of the install's CPU
# matching every wheel listed on the index pages against this machine's tags; pip 26 resolves the
# same set in a fraction of it. Then one pip run: the pin and the package resolve together (a second
# run costs ~3 CPU-s to find torch already there). --no-compile: pip would byte-compile every module
# of every package (~40 CPU-s, torch's and Triton's thousands of files); the interpreter compiles what
# is imported, on first import, and keeps it (~10 CPU-s for what the suite imports).
# docs/testing.md#timings has the figures.
install:
	$(PIP) install --quiet "pip>=26"
	$(PIP) install --quiet --no-compile "$(TORCH_SPEC)" -e ".[dev]"

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
