"""Next-token choice on the driver: greedy, or temperature + top-k sampling from a seeded
torch.Generator, so a run is a function of (checkpoint, prompt, config) whatever the launcher."""

from __future__ import annotations

import torch

from attnres_pp.generate.config import GenerationConfig


class Sampler:
    def __init__(self, gen_cfg: GenerationConfig) -> None:
        self.cfg = gen_cfg
        self.generator = torch.Generator().manual_seed(gen_cfg.seed)

    def __call__(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """Token ids `[B]` from the logits of the last position `[B, V]`."""
        logits_BV = logits_BV.detach().to("cpu", torch.float64)
        if self.cfg.greedy:
            return logits_BV.argmax(dim=-1)
        scaled_BV = logits_BV / self.cfg.temperature
        if 0 < self.cfg.top_k < scaled_BV.shape[-1]:
            kth_B1 = scaled_BV.topk(self.cfg.top_k, dim=-1).values[:, -1:]
            scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))
        probs_BV = torch.softmax(scaled_BV, dim=-1)
        return torch.multinomial(probs_BV, 1, generator=self.generator).squeeze(-1)
