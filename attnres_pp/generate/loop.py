"""The decode loop: prefill the prompt in one pass (in pieces of `prefill_chunk` tokens), then one
pass per new token, each feeding back the token the driver's sampler chose. Works with any
generator of `generate.engines`; only token ids and last-position logits cross to the driver."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.sampling import Sampler
from attnres_pp.model import ModelConfig

# A progress line every this many new tokens (stderr; only when a progress callback is given).
PROGRESS_EVERY = 64


@dataclass
class GenerationResult:
    """tokens: the new token ids; prefill_s: prompt pass to first token; decode_s: each later token."""

    tokens: list[int]
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)

    @property
    def decode_s_per_token(self) -> float:
        """Mean seconds per decoded token (0.0 when only the prefill's token was generated)."""
        return statistics.fmean(self.decode_s) if self.decode_s else 0.0


def prefill_pieces(n_prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(start, n) of each prefill piece: `chunk` tokens each, the last one shorter; chunk 0 = one piece."""
    chunk = chunk or n_prompt
    return [(start, min(chunk, n_prompt - start)) for start in range(0, n_prompt, chunk)]


def check_fits(cfg: ModelConfig, n_prompt: int, max_new_tokens: int) -> None:
    """Raise ValueError saying what to change if the prompt or the request does not fit the model.

    The last new token is never fed back, so a run needs n_prompt + max_new_tokens - 1 positions.
    Longer runs are refused rather than slid: the learned positions end at seq_len.
    """
    if n_prompt < 1:
        raise ValueError("the prompt is empty: give at least one token (--prompt TEXT or --prompt-file FILE)")
    needed = n_prompt + max_new_tokens - 1
    if needed > cfg.seq_len:
        room = cfg.seq_len - n_prompt + 1
        fix = (f"use --max-new-tokens {room} or less" if room >= 1
               else f"shorten the prompt to at most {cfg.seq_len} tokens")
        raise ValueError(f"the prompt ({n_prompt} tokens) plus --max-new-tokens {max_new_tokens} needs {needed} "
                         f"positions, but the model's context is seq_len={cfg.seq_len} (no sliding window): {fix}")


def generate(generator, prompt_ids: list[int], gen_cfg: GenerationConfig,
             progress: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate `gen_cfg.max_new_tokens` tokens after `prompt_ids` (one sequence)."""
    check_fits(generator.cfg, len(prompt_ids), gen_cfg.max_new_tokens)
    sampler = Sampler(gen_cfg)
    generator.reset()
    started = time.perf_counter()
    logits_BV = generator.forward(prefill_pieces(len(prompt_ids), gen_cfg.prefill_chunk),
                                  torch.tensor([prompt_ids], dtype=torch.long))
    next_B = sampler(logits_BV)
    result = GenerationResult(tokens=[int(next_B[0])], prefill_s=time.perf_counter() - started)
    for position in range(len(prompt_ids), len(prompt_ids) + gen_cfg.max_new_tokens - 1):
        started = time.perf_counter()
        next_B = sampler(generator.forward([(position, 1)], next_B.view(1, 1)))
        result.decode_s.append(time.perf_counter() - started)
        result.tokens.append(int(next_B[0]))
        if progress is not None and len(result.tokens) % PROGRESS_EVERY == 0:
            progress(f"  {len(result.tokens)}/{gen_cfg.max_new_tokens} tokens, "
                     f"{1e3 * result.decode_s_per_token:.2f} ms/token")
    return result
