"""One thread per test process: two xdist workers share the machine's two cores."""

import torch

torch.set_num_threads(1)
