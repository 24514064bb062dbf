"""What an exported attnres-pp model keeps between generation steps, beside the attention keys and
values transformers' cache object holds per layer (`DynamicCache`, `layer_idx` = the layer's index):
MSAR's convolution history. A stream's causal convolution at token t reads its source at t - delta
for delta < kappa, so each reading site keeps, per source it reads, that source's last
max(kappa) - 1 positions; a step convolves them followed by its new positions and keeps the tail.
Depth attention itself is per token and needs nothing kept. The history lives on the cache object
(an attribute), so it goes wherever transformers hands the cache."""

from __future__ import annotations

import torch

_HISTORY = "attnres_conv_history"


def past_length(cache) -> int:
    """Tokens the cache holds already (0 without a cache, or before the first step)."""
    return 0 if cache is None else int(cache.get_seq_length())


class ConvHistory:
    """The history of one reading site: per source index, its last `keep` positions [B, <= keep, d]."""

    def __init__(self, store: dict, site: int, keep: int) -> None:
        self.store, self.site, self.keep = store, site, keep

    def extend(self, source: int, v_BTD: torch.Tensor) -> torch.Tensor:
        """The kept positions of `source` followed by `v_BTD` (what the convolution reads), and keeps
        the new tail for the next step."""
        before = self.store.get((self.site, source))
        full = v_BTD if before is None else torch.cat([before, v_BTD], dim=1)
        self.store[(self.site, source)] = full[:, full.shape[1] - min(self.keep, full.shape[1]):]
        return full


def site_history(cache, site: int, keep: int) -> ConvHistory | None:
    """Reading site `site`'s history on `cache` (None without a cache, or with nothing to keep)."""
    if cache is None or keep < 1:
        return None
    store = getattr(cache, _HISTORY, None)
    if store is None:
        store = {}
        setattr(cache, _HISTORY, store)
    return ConvHistory(store, site, keep)


def reorder(cache, beam_idx: torch.LongTensor):
    """Beam search's reordering of the cache's rows: the keys and values (the cache's own) and the
    convolution history alike. Returns the cache."""
    cache.reorder_cache(beam_idx)
    store = getattr(cache, _HISTORY, {})
    for key, kept in store.items():
        store[key] = kept.index_select(0, beam_idx.to(kept.device))
    return cache
