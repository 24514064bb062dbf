"""`--tensorboard DIR`: the run's per-step records as TensorBoard scalars (`torch.utils.tensorboard`, the
optional extra `[tb]`). Every number of a metrics.jsonl line becomes one scalar at that step, under a
group (train/, val/, perf/, pipeline/, routing/, moe/); a list becomes one scalar per entry (routing
entropy per site, bubble per rank); the memory figures the ranks report and an MoE model's tokens per
expert (`moe/tokens_layer_<l>_expert_<e>`) come from the step's extras.
It only reads what the loop already recorded: a run trains the same with or without it."""

from __future__ import annotations

import resource
from pathlib import Path

TB_INSTALL_HINT = "pip install 'attnres-pp[tb]' (or pip install tensorboard)"

# metrics.jsonl key -> TensorBoard tag; keys not listed go under misc/KEY.
TAGS = {
    "loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s",
    "bubble_fraction": "pipeline/bubble_fraction", "rank_bubbles": "pipeline/bubble_rank",
    "driver_bytes": "pipeline/driver_bytes",
    "routing_entropy": "routing/entropy_site", "routing_embedding_weight": "routing/embedding_weight_site",
    "moe_load_max_over_mean": "moe/load_max_over_mean", "moe_aux_loss": "moe/aux_loss",
}
# Per-layer keys "PREFIX<layer>" -> "TAG<layer>".
PREFIX_TAGS = {"moe_load_max_over_mean/": "moe/load_max_over_mean_layer_"}
MEMORY_EXTRAS = {"peak_rss_bytes_per_rank": "memory/peak_rss_bytes_rank",
                 "cache_peak_bytes_per_rank": "memory/cache_peak_bytes_rank"}


def check_tensorboard() -> None:
    """ValueError with the install command when the tensorboard package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(f"--tensorboard needs the tensorboard package: {TB_INSTALL_HINT}") from None


def scalar_items(record: dict) -> list[tuple[str, float]]:
    """(tag, value) of every number in a metrics.jsonl record but the step; lists as TAG_<index>."""
    items = []
    for key, value in record.items():
        if key == "step":
            continue
        tag = TAGS.get(key) or _prefixed_tag(key) or f"misc/{key}"
        if isinstance(value, list | tuple):
            items += [(f"{tag}_{i}", float(v)) for i, v in enumerate(value) if _is_number(v)]
        elif _is_number(value):
            items.append((tag, float(value)))
    return items


def _prefixed_tag(key: str) -> str | None:
    for prefix, tag in PREFIX_TAGS.items():
        if key.startswith(prefix):
            return tag + key[len(prefix):]
    return None


def expert_load_items(extras: dict | None) -> list[tuple[str, float]]:
    """(tag, tokens) of every MoE layer's routed experts in the step's extras (`moe_expert_loads`)."""
    loads = (extras or {}).get("moe_expert_loads") or {}
    return [(f"moe/tokens_layer_{layer}_expert_{e}", float(tokens))
            for layer, tokens_E in loads.items() for e, tokens in enumerate(tokens_E)]


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class TensorBoardLog:
    """One SummaryWriter under `log_dir`; `write(record, extras)` after each step, `close()` at the end."""

    def __init__(self, log_dir: str | Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict, extras: dict | None = None) -> None:
        step = int(record["step"])
        for tag, value in scalar_items(record) + expert_load_items(extras):
            self.writer.add_scalar(tag, value, global_step=step)
        for key, tag in MEMORY_EXTRAS.items():
            for rank, value in enumerate((extras or {}).get(key) or ()):
                self.writer.add_scalar(f"{tag}_{rank}", float(value), global_step=step)
        # This process's own peak resident memory (the whole model in a single-process run).
        self.writer.add_scalar("memory/driver_peak_rss_bytes",
                               float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
