"""Depth-attention ops: `phase1` (batched read of completed sources) and `phase2` (online-softmax
merge of the open partial), and `phase1_streams` (MSAR's conv streams and phase 1 fused), with a
pure-torch backend and a Triton backend.

This package imports nothing else from the project.
"""

from attnres_pp.kernels.dispatch import phase1, phase1_streams, phase2, resolve_backend
from attnres_pp.kernels.reference import (
    conv_streams_torch,
    phase1_conv_streams_torch,
    phase1_normalized_torch,
    phase1_streams_torch,
    phase1_torch,
    phase2_streams_torch,
    phase2_torch,
    rms_normalize,
)

__all__ = ["phase1", "phase1_streams", "phase2", "resolve_backend", "phase1_torch", "phase2_torch",
           "phase1_normalized_torch", "phase1_streams_torch", "phase2_streams_torch", "conv_streams_torch",
           "phase1_conv_streams_torch", "rms_normalize"]
