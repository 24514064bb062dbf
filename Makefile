# Set-up and the two entry points of the README: `make demo` (train the default model) and
# `make test` (the CI suite). torch is pinned to the CPU build that these machines hold on disk;
# an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint

install:
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"

# The demo run is rewritten each time: a fresh run refuses a folder holding another run's
# checkpoints (it would otherwise load them on a restart). Continue one with --resume instead.
demo: install
	rm -rf runs/demo
	attnres-pp train --out runs/demo

test: install
	bash scripts/run_tests.sh -n $(PYTEST_WORKERS)

lint:
	ruff check .
