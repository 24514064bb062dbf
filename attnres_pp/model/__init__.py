"""The model family of SPEC section 1: config, layers, depth attention, the whole Transformer."""

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.stack import DepthState, forward_sublayers
from attnres_pp.model.transformer import Transformer, parameter_count

__all__ = ["ModelConfig", "DepthState", "Transformer", "forward_sublayers", "parameter_count"]
