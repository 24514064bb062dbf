"""GenerationConfig: what to generate, how to sample, and on which device and dtype. Frozen and
validated; the CLI fills it in. How the model is split (stages, virtual stages, launcher) is a
`PipelineConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnres_pp.launch.resolve import DEVICES, DTYPES


def _fail(field_name: str, value, fix: str) -> None:
    raise ValueError(f"GenerationConfig.{field_name}={value!r} is invalid: {fix}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """max_new_tokens: tokens to generate per sequence. prefill_chunk: prompt tokens per prefill
    piece (0 = the whole prompt as one piece; pieces let a pipeline's ranks work on the prompt at
    once). temperature 0 is greedy (argmax); top_k 0 keeps the whole vocabulary; seed seeds each
    sequence's sampler. stop: byte strings; a sequence ends where it first generates one of them,
    which is left out of its output. device: auto | cpu | cuda and dtype: auto | fp32 | bf16, as in
    training (`launch.resolve` decides; auto: cuda when every rank gets a GPU, bf16 there, fp32 on cpu).
    window: the keys and values a token attends to, itself included (None: the model's trained
    seq_len); the generator's key/value cache holds that many positions per layer, however long
    the run (`model.decode_state`)."""

    max_new_tokens: int = 64
    prefill_chunk: int = 0
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[bytes, ...] = ()
    device: str = "auto"
    dtype: str = "auto"
    window: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            _fail("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        for name, hint in (("prefill_chunk", " (0 = the whole prompt in one piece)"),
                           ("top_k", " (0 = no top-k filter)"), ("seed", "")):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                _fail(name, value, "must be an integer >= 0" + hint)
        if (not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            _fail("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            _fail("window", self.window, "must be an integer >= 1 (--window N: the keys each new token attends "
                                         "to, itself included; default the model's seq_len)")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, bytes) or not s for s in self.stop):
            _fail("stop", self.stop, "must be a tuple of non-empty byte strings (--stop S, S not empty)")
        for name, choices in (("device", DEVICES), ("dtype", DTYPES)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"choose one of {', '.join(choices)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
