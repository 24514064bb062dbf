"""The model family of docs/spec.md section 1: config, layers, depth attention, the whole Transformer.

`attnres_pp.model.config` stays torch-free (the simulator reads ModelConfig without torch); the
torch-backed parts load on first use.
"""

from attnres_pp.model.config import ModelConfig

_LAZY = {"DepthState": "stack", "forward_sublayers": "stack", "Transformer": "transformer",
         "parameter_count": "transformer", "DecodeState": "decode_state"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"attnres_pp.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnres_pp.model' has no attribute {name!r}")


__all__ = ["ModelConfig", "DecodeState", "DepthState", "Transformer", "forward_sublayers", "parameter_count"]
