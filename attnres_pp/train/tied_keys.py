"""A tied embedding's checkpoint keys. Where the embedding and the LM head sit on two pipeline ranks
(`comm.partition.tied_copy_ranks`) the last rank holds the head's copy of the matrix, named
`head.lm_head.weight` in its model; a checkpoint stores it (and its AdamW state) under the embedding's
name, equal to the first rank's copy (`grad_sync.TiedEmbedding` keeps them equal), so a checkpoint
holds the one matrix once, whatever the split, as the single process's does, and loads into any split."""

from __future__ import annotations

from torch import nn

TIED_COPY, TIED_KEY = "head.lm_head.weight", "embed.tok.weight"


def _tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "cfg", None), "tie_embeddings", False))


def stored_key(model: nn.Module, key: str) -> str:
    """The checkpoint key of a rank's state key (a parameter `name` or `optim.<name>.<field>`)."""
    if not _tied(model):
        return key
    if key == TIED_COPY:
        return TIED_KEY
    prefix = f"optim.{TIED_COPY}."
    return f"optim.{TIED_KEY}.{key[len(prefix):]}" if key.startswith(prefix) else key


def stored(model: nn.Module, state: dict) -> dict:
    """`state` keyed as the checkpoint stores it (`stored_key`)."""
    return {stored_key(model, key): value for key, value in state.items()}
