"""What an exported attnres-pp model keeps between generation steps, beside the attention keys and
values transformers' cache object holds per layer (`DynamicCache`, `layer_idx` = the layer's index;
under a sliding window the last sliding_window - 1 positions, `window_mask` saying which keys each
new position reads): MSAR's convolution history. A stream's causal convolution at token t reads its
source at t - delta for delta < kappa, so each reading site keeps, per source it reads, that
source's last max(kappa) - 1 positions; a step convolves them followed by its new positions and keeps the tail.
The attention window does not bound it: a tap reads its source's earlier position whether or not
that position's keys are still in the window (as `attnres-pp generate` does).
Depth attention itself is per token and needs nothing kept. The history lives on the cache object
(an attribute), so it goes wherever transformers hands the cache."""

from __future__ import annotations

import torch

_HISTORY = "attnres_conv_history"


def window_mask(past: int, seq: int, n_keys: int, window: int | None, device: torch.device) -> dict:
    """scaled_dot_product_attention's mask for queries at positions past .. past + seq - 1 over the
    last `n_keys` positions before past + seq: query p sees the keys of p - window + 1 .. p (every
    key up to p when `window` is None). The keys are the queries' own and the window holds them: the
    causal flag (the training forward's attention). ValueError for more keys than positions given
    (a static cache's fixed-size buffer: only transformers' dynamic caches are supported)."""
    if n_keys > past + seq:
        raise ValueError(f"the cache returned {n_keys} keys for {past + seq} positions: use a DynamicCache "
                         "(transformers' default cache; static caches are not supported)")
    if n_keys == seq and (window is None or seq <= window):
        return {"is_causal": True}
    query_pos_T1 = torch.arange(past, past + seq, device=device)[:, None]
    key_pos_1S = torch.arange(past + seq - n_keys, past + seq, device=device)[None, :]
    allowed_TS = key_pos_1S <= query_pos_T1
    if window is not None:
        allowed_TS = allowed_TS & (key_pos_1S > query_pos_T1 - window)
    return {} if bool(allowed_TS.all()) else {"attn_mask": allowed_TS}


def past_length(cache) -> int:
    """Positions the cache has taken in so far (0 without a cache, or before the first step); a
    sliding-window layer counts every one, not only those it keeps, so rotary positions continue."""
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
