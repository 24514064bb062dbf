"""Depth-attention ops: `phase1` (batched read of completed sources) and `phase2` (online-softmax
merge of the open partial), with a pure-torch backend and a Triton backend.

This package imports nothing else from the project.
"""

from attnres_pp.kernels.dispatch import phase1, phase2
from attnres_pp.kernels.reference import phase1_torch, phase2_torch, rms_normalize

__all__ = ["phase1", "phase2", "phase1_torch", "phase2_torch", "rms_normalize"]
