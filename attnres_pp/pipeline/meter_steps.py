"""Which training steps run the activation meter (`pipeline.memory_meter`), and the figure a step
reports when it does not.

The meter pays a saved-tensor hook on every tensor a forward saves (about 10 us a save, hundreds a
microbatch) for one number per step, `activation_peak_bytes`. That number is a function of what the
rank's actions save and free, in the schedule's order: where every step saves the same tensors
(the same shapes, the same microbatch count, the same code path) it is the same every step, so a run
of that kind meters its first steps only and reports their figure after them. A step's figure can
differ from the step before when:

- an MoE sublayer routes tokens: each expert's rows are the tokens sent to it, so the shapes the
  experts save change with the routing, step by step (and with expert parallelism, what arrives);
- the step's batch has another shape than the metered steps' (a ragged or variable-length batch,
  another microbatch size or count): `MeterSteps` meters again from the first step of the new shape;
- activation checkpointing under a split schedule (I and W actions): I's choice of weight store
  (`weight_store.choose_store`) weighs the checkpoint inputs as the meter counts them, so the meter
  is part of the step's decision and runs every step;
- the first step: lazy set-up on the first forward or backward (FSDP2's, the graph cut's cache) may
  save what later steps do not, and the optimizer state that appears after step 1 is not an
  activation, so a run meters at least `METERED_STEPS` (2: one step after the optimizer's first
  step) and then until two metered steps in a row agree.

Neither checkpointing's recomputation alone (the same layers recompute the same tensors every step)
nor the split schedules' W store alone (the same products stash the same operands; the cut is cached
per chunk) makes the figure move; they are metered as any fixed-shape run.

`StageRuntime.meter_every_step` meters every step of any run (a one-process run's too: it is one
rank): the slow twin the figures are tested against (tests/unit/test_meter_steps.py).
"""

from __future__ import annotations

import torch

from attnres_pp.model.moe import moe_sublayers

METERED_STEPS = 2  # the first step and one after the optimizer's first step


def figures_can_change(chunks, has_weight_actions: bool) -> str | None:
    """Why the activation figures of a rank holding `chunks` (modules) can change from step to step,
    or None when only the batch's shape can change them. `has_weight_actions`: the schedule splits
    the backward into I and W."""
    modules = list(chunks)
    if any(moe_sublayers(m) for m in modules):
        return "an MoE sublayer's expert rows follow the routing"
    if has_weight_actions and any(getattr(m, "activation_checkpoint", "none") != "none" for m in modules):
        return "I's weight-store choice reads the meter's counts of the checkpoint inputs"
    return None


def batch_signature(*batches: list[torch.Tensor] | None) -> tuple:
    """The shapes, dtypes and devices of a step's microbatch lists (None: a rank that reads none)."""
    return tuple(None if mbs is None else tuple((tuple(t.shape), t.dtype, t.device) for t in mbs)
                 for mbs in batches)


class MeterSteps:
    """Per rank: `start(signature)` says whether this step runs the meter; `finish(peak)` takes the
    metered peak (None for an unmetered step) and returns the step's `activation_peak_bytes`."""

    def __init__(self, *, every_step: bool, metered_steps: int = METERED_STEPS) -> None:
        if metered_steps < 2:
            raise ValueError(f"metered_steps={metered_steps} is invalid: meter at least 2 steps (the first, "
                             "and one after the optimizer's first step)")
        self.every_step = every_step
        self.metered_steps = metered_steps
        self._signature: tuple | None = None
        self._n_metered = 0  # steps metered since the batch's shape last changed
        self._last: tuple[int, ...] = ()  # their last two figures

    def start(self, signature: tuple) -> bool:
        if signature != self._signature:  # a new shape: its figures are not known yet
            self._signature, self._n_metered, self._last = signature, 0, ()
        return self.every_step or not self.settled

    @property
    def settled(self) -> bool:
        """Enough steps of this shape metered, the last two agreeing: later steps report the last."""
        return self._n_metered >= self.metered_steps and self._last[0] == self._last[1]

    def finish(self, peak_bytes: int | None) -> int:
        if peak_bytes is None:
            return self._last[-1]
        self._n_metered += 1
        self._last = (*self._last[-1:], peak_bytes)
        return peak_bytes
