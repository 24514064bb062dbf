"""Which W store a chunk's I leaves (docs/spec.md section 8), by the bytes each would hold until W.
One rule for the runtime (`pipeline.weight_store`, on measured tensors) and the memory model
(`simulator.memory_activation`, on shapes). Torch-free.

Both stores keep each linear layer's output gradient. Beside it
- the operand store keeps the layer's input operand (what its matrix product saved);
- the gradient store keeps the chunk's checkpointed layer inputs (and, under selective
  checkpointing, the projections' outputs the policy kept), from which W recomputes the operands:
  one more forward of each layer, its products served from the kept outputs where there are any.
Without checkpointing there is nothing to recompute from: the operand store.
"""

from __future__ import annotations

OPERANDS, GRADIENTS = "operands", "gradients"


def weight_store_kind(operand_bytes: int, checkpoint_bytes: int | None) -> str:
    """`GRADIENTS` when the checkpoint inputs W would recompute from (`checkpoint_bytes`, None: the
    chunk is not checkpointed) are fewer bytes than the linear operands (`operand_bytes`); else
    `OPERANDS` (ties too: the gradient store costs a forward more)."""
    if checkpoint_bytes is None or checkpoint_bytes >= operand_bytes:
        return OPERANDS
    return GRADIENTS


def weight_store_bytes(grad_bytes: int, operand_bytes: int, checkpoint_bytes: int | None) -> int:
    """The bytes the chosen store (`weight_store_kind`) holds between I and W."""
    kind = weight_store_kind(operand_bytes, checkpoint_bytes)
    return grad_bytes + (operand_bytes if kind == OPERANDS else checkpoint_bytes)
