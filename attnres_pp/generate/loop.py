"""The decode loop over a batch of sequences: prefill the prompts in one pass (in pieces of
`prefill_chunk` tokens; a prompt longer than the trained seq_len in several passes of at most
that), then one pass per position, each feeding back the tokens the driver's samplers chose. A
rotary-position model runs past its trained length (its caches slide over the generator's
attention window); a learned-position one stops at seq_len (`check_fits`). Works with any
generator of `generate.engines`; only token ids and last-position
logits cross to the driver.

Prompts of different lengths run ragged, without padding or masks: every sequence of the batch is
at the same position in every pass. The prefill covers the positions every prompt has (the
shortest prompt's length); from there a pass feeds, per sequence, its next prompt token while it
has one (its logits are not sampled) and its last sampled token after that. So each sequence sees
exactly the tokens and positions it sees alone, and its greedy output equals its output alone;
the cost is that the part of a longer prompt beyond the shortest one is fed a token per pass. A
sequence that is done (max_new_tokens, or a stop string) leaves the batch: every rank drops its
rows from its caches (`keep_rows`) before the next pass.
Each sequence samples with its own generator seeded by `seed`, so its sampled tokens, too, are
those it gets alone (up to the rounding of a batched forward).

Stop strings match the new tokens as bytes (a byte run), or, given a `decode` (a run with a BPE
tokenizer, whose tokens are not bytes), the decoded text of the new tokens: a sequence stops once
its text contains a stop string; its `text` is cut before it and its `tokens` are those whose text
lies wholly before it.
"""

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
    """tokens: the new token ids (a stop string and what follows left out); prefill_s: the start to
    the first new token (the prefill, and the passes feeding the rest of a longer prompt);
    decode_s: each later token's pass; stopped_at: the stop string that ended it, or None;
    text: with a text stop, the decoded text cut before the stop string (else None: decode `tokens`)."""

    tokens: list[int]
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)
    stopped_at: bytes | None = None
    text: str | None = None

    @property
    def decode_s_per_token(self) -> float:
        """Mean seconds per decoded token (0.0 when only the prefill's token was generated)."""
        return statistics.fmean(self.decode_s) if self.decode_s else 0.0


def prefill_passes(n_prompt: int, chunk: int, longest: int) -> list[list[tuple[int, int]]]:
    """The prefill's passes, each a list of (start, n) pieces of `chunk` tokens (the last one of a
    pass shorter; chunk 0 = one piece per pass). A pass spans at most `longest` positions (the
    trained seq_len): a piece, like a training sequence, holds at most that many tokens, and the
    decode state keeps a source's history for one such pass (`model.decode_state`), so a longer
    rotary-position prompt is prefilled in several passes."""
    chunk = min(chunk or longest, longest)
    return [[(start, min(chunk, stop - start)) for start in range(first, stop, chunk)]
            for first in range(0, n_prompt, longest) for stop in [min(first + longest, n_prompt)]]


def check_fits(cfg: ModelConfig, n_prompt: int, max_new_tokens: int) -> None:
    """Raise ValueError saying what to change if the prompt or the request does not fit the model.

    Rotary positions continue past the trained length (the key/value cache slides: `DecodeState`),
    so only learned positions bound a run: it needs n_prompt + max_new_tokens - 1 positions (the
    last new token is never fed back), and the learned table ends at seq_len.
    """
    if n_prompt < 1:
        raise ValueError("the prompt is empty: give at least one token (--prompt TEXT or --prompt-file FILE)")
    if cfg.positions != "learned":
        return
    needed = n_prompt + max_new_tokens - 1
    if needed > cfg.seq_len:
        room = cfg.seq_len - n_prompt + 1
        fix = (f"use --max-new-tokens {room} or less" if room >= 1
               else f"shorten the prompt to at most {cfg.seq_len} tokens")
        raise ValueError(f"the prompt ({n_prompt} tokens) plus --max-new-tokens {max_new_tokens} needs {needed} "
                         f"positions, but the model's context is seq_len={cfg.seq_len} (no sliding window): {fix}")


def generate(generator, prompt_ids: list[int], gen_cfg: GenerationConfig,
             progress: Callable[[str], None] | None = None,
             decode: Callable[[list[int]], str] | None = None) -> GenerationResult:
    """Generate up to `gen_cfg.max_new_tokens` tokens after `prompt_ids` (one sequence)."""
    return generate_batch(generator, [prompt_ids], gen_cfg, progress, decode)[0]


def _hit_text_stop(result: GenerationResult, stops: tuple[bytes, ...], decode: Callable[[list[int]], str]) -> bool:
    """If the decoded new text contains a stop string, cut the text before its first one, and the
    tokens to those whose text is wholly before it."""
    text = decode(result.tokens)
    found = [(text.find(s.decode("utf-8", errors="replace")), s) for s in stops]
    found = [(at, s) for at, s in found if at >= 0]
    if not found:
        return False
    at, result.stopped_at = min(found, key=lambda f: (f[0], -len(f[1])))
    result.text = text[:at]
    keep = len(result.tokens)
    while keep and not result.text.startswith(decode(result.tokens[:keep])):
        keep -= 1
    del result.tokens[keep:]
    return True


def _hit_stop(result: GenerationResult, stops: tuple[bytes, ...]) -> bool:
    """If the newest token completes a stop string, cut it off (the longest, if several end here)."""
    ending = [s for s in stops if len(result.tokens) >= len(s) and result.tokens[-len(s):] == list(s)]
    if not ending:
        return False
    result.stopped_at = max(ending, key=len)
    del result.tokens[-len(result.stopped_at):]
    return True


def generate_batch(generator, prompts: list[list[int]], gen_cfg: GenerationConfig,
                   progress: Callable[[str], None] | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> list[GenerationResult]:
    """Generate up to `gen_cfg.max_new_tokens` tokens after each prompt, all in one batch; one
    result per prompt, in order. `decode` (token ids to text): stop strings match the decoded text
    rather than the token bytes."""
    if not prompts:
        raise ValueError("no prompts: give at least one")
    for ids in prompts:
        check_fits(generator.cfg, len(ids), gen_cfg.max_new_tokens)
    batch, n_common = len(prompts), min(len(ids) for ids in prompts)
    samplers = [Sampler(gen_cfg) for _ in prompts]
    results = [GenerationResult(tokens=[], prefill_s=0.0) for _ in prompts]
    active = [True] * batch
    generator.reset()
    started = pass_started = time.perf_counter()
    common_BT = torch.tensor([ids[:n_common] for ids in prompts], dtype=torch.long)
    for pieces in prefill_passes(n_common, gen_cfg.prefill_chunk, generator.cfg.seq_len):
        logits_BV = generator.forward(pieces, common_BT[:, pieces[0][0]:sum(pieces[-1])])
    position = n_common  # the position whose token the last pass's logits predict
    fed = [ids[n_common - 1] for ids in prompts]
    in_batch = list(range(batch))  # the prompt of each row the generator holds
    reported = 0
    while True:
        for index, row in enumerate(in_batch):
            ids = prompts[row]
            if position < len(ids):
                fed[row] = ids[position]  # still in its prompt: its logits are not sampled
                continue
            result = results[row]
            fed[row] = int(samplers[row](logits_BV[index:index + 1])[0])
            now = time.perf_counter()
            if result.tokens:
                result.decode_s.append(now - pass_started)
            else:
                result.prefill_s = now - started
            result.tokens.append(fed[row])
            stopped = (_hit_stop(result, gen_cfg.stop) if decode is None
                       else bool(gen_cfg.stop) and _hit_text_stop(result, gen_cfg.stop, decode))
            if stopped or len(result.tokens) == gen_cfg.max_new_tokens:
                active[row] = False
        if not any(active):
            return results
        generated = max(len(r.tokens) for r in results)
        if progress is not None and generated % PROGRESS_EVERY == 0 and generated != reported:
            reported = generated
            mean_s = statistics.fmean(s for r in results for s in r.decode_s)
            progress(f"  {generated}/{gen_cfg.max_new_tokens} tokens, {1e3 * mean_s:.2f} ms/token")
        pass_started = time.perf_counter()
        if not all(active[row] for row in in_batch):  # some are done: drop them from every cache
            generator.keep_rows([index for index, row in enumerate(in_batch) if active[row]])
            in_batch = [row for row in in_batch if active[row]]
        tokens_B1 = torch.tensor([fed[row] for row in in_batch], dtype=torch.long).view(len(in_batch), 1)
        logits_BV = generator.forward([(position, 1)], tokens_B1)
        position += 1
