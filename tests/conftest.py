"""Process-wide test settings.

- One thread per test process: two xdist workers share the machine's two cores.
- Without CUDA the Triton kernels run under the interpreter; TRITON_INTERPRET must be set before
  anything imports triton (torch._dynamo does), so it is set here, before any test module loads.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
