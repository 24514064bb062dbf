"""Refuse, before anything is allocated, a model whose training state cannot fit this machine.

A model of `--d-model 65536` asks the allocator for tens of GB in its first layer and the run ends
in a `RuntimeError` traceback from deep inside a rank. Training keeps, at the least, one copy of
every parameter, its gradient and AdamW's two moments (fp32 master weights under every dtype, also
under bf16 autocast), i.e. 16 bytes a parameter across the whole run however it is split. When the
ranks run on this machine (the local and in-process launchers, and Ray's private instance), that
lower bound must fit its physical memory; a Ray cluster (`--address`) spreads it over hosts whose
memory this process cannot see, so it is not checked there.
"""

from __future__ import annotations

import os

from attnres_pp.model.transformer import parameter_count

# fp32 parameter + fp32 gradient + AdamW exp_avg and exp_avg_sq.
TRAINING_BYTES_PER_PARAMETER = 16


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_training_fits(run_cfg, *, address: str | None, memory_bytes: int | None = None) -> None:
    """Raise ValueError naming the model flags when the run's training state exceeds this machine's
    memory (`memory_bytes`, default: physical memory)."""
    if run_cfg.pipeline.launcher == "ray" and (address or os.environ.get("RAY_ADDRESS")):
        return
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    if memory is None:
        return
    model = run_cfg.model
    params = parameter_count(model)
    needed = params * TRAINING_BYTES_PER_PARAMETER
    if needed > memory:
        raise ValueError(
            f"--d-model {model.d_model} --layers {model.n_layers} --vocab-size {model.vocab_size}: the model has "
            f"{params:,} parameters, and training holds at least {TRAINING_BYTES_PER_PARAMETER} bytes each "
            f"(weights, gradients, AdamW moments) = {needed / 2**30:,.1f} GiB, more than this machine's "
            f"{memory / 2**30:,.1f} GiB of memory: choose a smaller --d-model or --layers, or run on a Ray "
            "cluster with --launcher ray --address")
