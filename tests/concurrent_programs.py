"""The mark for tests that can fail only where a kernel's programs run concurrently (a GPU).

The Triton interpreter runs a launch's programs one after another in a fixed order, so two runs on
CPU are equal whatever the kernel does: a bitwise-determinism test cannot fail there.
tests/kernels/test_kernel_rules.py checks on CPU that no kernel uses atomics, the one way a backward
could differ between two runs on a GPU."""

import pytest
import torch

ONLY_WHERE_PROGRAMS_RUN_CONCURRENTLY = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="determinism can fail only where programs run concurrently (a GPU)")
