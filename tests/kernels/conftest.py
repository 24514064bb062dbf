"""Puts Triton into interpreter mode (TRITON_INTERPRET=1) for the kernel tests on machines without
a GPU, so that the kernels run on CPU tensors. With a GPU (and the variable unset) the same tests
run the compiled kernels on CUDA tensors instead; see `kernel_device` below.

Triton reads the variable when a kernel is decorated, and its own library functions are decorated
when `triton` is first imported, so it must be set before anything imports triton (note that
`import torch._dynamo` does). pytest imports this conftest when it enters this directory, before
the test modules here, in the main process and in every pytest-xdist worker; the test modules set
it too, for a direct import. Should some earlier-collected module have imported triton first, the
interpreter cannot work in this process: `kernel_device` then fails with instructions instead of
letting every kernel test fail obscurely.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _interpreter_runs_on_cpu() -> bool:
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr):
        tl.store(x_ptr + tl.arange(0, 2), tl.zeros([2], tl.float32))

    x = torch.ones(2)
    try:
        probe[(1,)](x)
    except Exception:
        return False
    return bool((x == 0).all())


@pytest.fixture
def kernel_device():
    """'cpu' under the interpreter, else 'cuda'. Factory calls without a device inside the test
    make tensors there."""
    if INTERPRET and not _interpreter_runs_on_cpu():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on CPU "
            "in this process; run `TRITON_INTERPRET=1 python -m pytest ...`"
        )
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: nothing can run the Triton kernels")
    device = "cpu" if INTERPRET else "cuda"
    with torch.device(device):
        yield device
