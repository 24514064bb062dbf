"""GenerationConfig: what to generate and how to sample. Frozen and validated; the CLI fills it in.
Where the model runs (stages, virtual stages, launcher) is a `PipelineConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _fail(field_name: str, value, fix: str) -> None:
    raise ValueError(f"GenerationConfig.{field_name}={value!r} is invalid: {fix}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """max_new_tokens: tokens to generate. prefill_chunk: prompt tokens per prefill piece (0 = the
    whole prompt as one piece; pieces let a pipeline's ranks work on the prompt at once).
    temperature 0 is greedy (argmax); top_k 0 keeps the whole vocabulary; seed seeds the sampler."""

    max_new_tokens: int = 64
    prefill_chunk: int = 0
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
