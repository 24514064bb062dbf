"""The curated list of pipelined-step parity cases: each case is one pipelined step over the loopback
transport that must equal the single-process model (loss and every gradient; fp32 to 1e-5, float64
to 1e-10). `tests/parity/test_parity.py` runs the one parity body over `CASES`, and checks that the list
still covers what docs/testing.md says it covers.

What the list holds, group by group (a case in two groups is listed once):
- SCHEDULE_CASES: every schedule generator, with Block AttnRes and MSAR, on a layout whose chunk
  edges are all block edges (cached hops carry completed blocks only) and on one where blocks run
  across chunk edges (a partial crosses the hop, P = 3, uneven splits where the schedule allows),
  cached; and Block AttnRes on the second layout without the cache.
- VARIANT_CASES: every residual variant on two layouts (loop placement with the fused backward,
  P = 3; V shape with the split backward and DualPipeV's F&B pairs, P = 2), cached and naive.
- ONE_RANK_CASES: P = 1 with V chunks, every hop a self-hop: every variant with blocks that close
  exactly at chunk edges (cached hops then carry nothing at all), cached and naive; Block AttnRes
  and MSAR with blocks across chunk edges.
- CHECKPOINT_CASES: activation checkpointing where its paths differ: every variant under `full` on
  a split schedule (the W store keeps the recomputation's operands for W) and under `selective` on
  the fused backward; Block AttnRes and MSAR under both policies on both backwards, the loop and
  V placements and DualPipeV.
- FLOAT64_CASES: the subset at 1e-10: the fused and split backwards, P = 3, both placements, every
  checkpointing policy on the split backward, and `blocks = N` (uneven block boundaries).
- RECIPE_CASES: the layer recipes beside the default one (rope, SwiGLU, as many kv heads as query
  heads; every case above): grouped kv heads with QK-norm, one kv head with tied embeddings (on
  schedules whose first and last chunks share a rank), and the recipe of every checkpoint written
  before (learned positions, GELU), each variant on the loop and the V layouts, under both
  checkpointing policies, and in float64.
- TIED_CASES: tied embeddings on every schedule (tests/parity/test_tied_embeddings.py runs them on
  rank-local models: the loop placement's first and last ranks each hold a copy of the matrix, summed
  by the embedding group; the V placement's one rank holds one), cached and naive, P = 2 and 3, under
  checkpointing, and in float64.
- MOE_CASES: mixtures of experts (a dense first layer, routed and shared experts, the aux loss in
  the backward; a sigmoid router with one expert per token), every variant on the loop and V
  layouts, both checkpointing policies, one rank, and float64.
- BF16_SPLIT_CASES (run by tests/parity/test_split_bf16.py against the single-process bf16 model,
  whose backward is fused): every split schedule under bf16 autocast, where the W store keeps the
  bf16 operands of the weights' casts; Block AttnRes and MSAR, the MoE recipe (the routed experts'
  grouped matmul), and full checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.config import AC_POLICIES
from attnres_pp.schedule.schedules import SCHEDULES, schedule_placement
from tests.pipeline_helpers import model_config
from tests.reference_model import VARIANTS

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Mixed precision: fp32 master weights, compute under autocast (`model.precision`); not a parameter dtype.
AUTOCAST_DTYPES = {"bfloat16": "bf16"}
# Layer recipes (docs/spec.md section 11) beside the default: ModelConfig fields over model_config's
# d_model 16 (4 query heads of 4 channels where kv heads are grouped).
RECIPES = {
    "default": {},
    "grouped": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True},
    "mqa-tied": {"n_heads": 4, "n_kv_heads": 1, "tie_embeddings": True},
    "legacy": {"positions": "learned", "mlp": "gelu"},
    # Mixtures of experts (docs/spec.md section 12): the first layer dense, then four routed experts of
    # which each token reaches two, one shared expert, and the aux loss in the backward.
    "moe": {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 8, "moe_dense_layers": 1,
            "moe_balance": "aux_loss"},
    "moe-sigmoid": {"moe_experts": 4, "moe_top_k": 1, "moe_d_ff": 12, "moe_router": "sigmoid",
                    "n_kv_heads": 1},
}

# Schedules whose backward is split into I and W (they run through the weight store).
SPLIT_SCHEDULES = ("zb_h1", "interleaved_zb", "zbv", "dualpipev")


@dataclass(frozen=True, kw_only=True)
class ParityCase:
    """One pipelined step: `variant` (a key of tests.reference_model.VARIANTS) with `n_layers`
    layers split into P x V chunks, run by `schedule` over m microbatches. `block_size` None keeps
    the variant's own; it never changes Full AttnRes (blocks of one) or the standard residual.
    `blocks` > 0 sets N blocks instead (uneven boundaries)."""

    variant: str
    schedule: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    n_layers: int
    block_size: int | None = None
    blocks: int = 0
    cache: bool = True
    policy: str = "none"
    dtype: str = "float32"
    recipe: str = "default"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} is unknown: choose one of {', '.join(VARIANTS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
        if self.policy not in AC_POLICIES:
            raise ValueError(f"policy={self.policy!r} is unknown: choose one of {', '.join(AC_POLICIES)}")
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r} is unknown: choose one of {', '.join(RECIPES)}")
        if self.dtype not in DTYPES and self.dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown: choose one of {', '.join([*DTYPES, *AUTOCAST_DTYPES])}")
        if self.n_layers < self.n_stages * self.n_virtual:
            raise ValueError(f"{self.n_layers} layers cannot fill P x V = {self.n_stages * self.n_virtual} chunks: "
                             "give every chunk a layer")

    @property
    def id(self) -> str:
        blocks = f"N{self.blocks}" if self.blocks else f"S{self.config().block_size}"
        return (f"{self.variant}-{self.schedule}-P{self.n_stages}V{self.n_virtual}m{self.n_microbatches}"
                f"L{self.n_layers}{blocks}-{'cached' if self.cache else 'naive'}-{self.policy}-{self.dtype}"
                + ("" if self.recipe == "default" else f"-{self.recipe}"))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameters' dtype (fp32 under autocast: the master weights)."""
        return DTYPES.get(self.dtype, torch.float32)

    @property
    def precision(self) -> str:
        """`model.precision`: "fp32" (which runs float64 parameters as they are) or the autocast one."""
        return AUTOCAST_DTYPES.get(self.dtype, "fp32")

    @property
    def split(self) -> bool:
        return self.schedule in SPLIT_SCHEDULES

    def config(self) -> ModelConfig:
        overrides = {}
        if self.variant not in ("standard", "full"):
            if self.block_size is not None:
                overrides["block_size"] = self.block_size
            if self.blocks:
                overrides["blocks"] = self.blocks
        return model_config(self.variant, self.n_layers, **overrides, **RECIPES[self.recipe])

    def partition(self) -> Partition:
        return make_partition(self.n_layers, self.n_stages, self.n_virtual,
                              placement=schedule_placement(self.schedule))

    def edges_meet(self) -> bool:
        """True if every chunk edge is a block edge: no hop carries an open partial."""
        ends = set(self.config().block_ends)
        partition = self.partition()
        return all(partition.sublayer_range(c).stop in ends for c in range(partition.n_chunks - 1))


def _case(layout: tuple[str, int, int, int, int, int | None], variant: str, **rest) -> ParityCase:
    schedule, P, V, m, n_layers, block_size = layout
    return ParityCase(variant=variant, schedule=schedule, n_stages=P, n_virtual=V, n_microbatches=m,
                      n_layers=n_layers, block_size=block_size, **rest)


# (schedule, P, V, m, n_layers, block_size) per schedule: first every chunk edge a block edge, then
# blocks across chunk edges (P = 3 and an uneven split where the schedule allows). m is mostly not a
# multiple of P, and each V schedule runs once at its fewest microbatches (2P - 1 for ZB-V, 2P for
# DualPipeV).
SCHEDULE_LAYOUTS = {
    "gpipe": [("gpipe", 2, 2, 3, 4, 2), ("gpipe", 2, 2, 3, 5, 3)],
    "1f1b": [("1f1b", 2, 1, 3, 4, 4), ("1f1b", 3, 1, 4, 5, 3)],
    "interleaved_1f1b": [("interleaved_1f1b", 2, 2, 4, 4, 2), ("interleaved_1f1b", 3, 2, 3, 6, 5)],
    "zb_h1": [("zb_h1", 3, 1, 4, 6, 2), ("zb_h1", 3, 1, 4, 5, 3)],
    "interleaved_zb": [("interleaved_zb", 2, 2, 3, 4, 2), ("interleaved_zb", 3, 2, 4, 7, 5)],
    "zbv": [("zbv", 3, 2, 5, 6, 2), ("zbv", 2, 2, 3, 4, 3)],
    "dualpipev": [("dualpipev", 2, 2, 4, 4, 2), ("dualpipev", 3, 2, 7, 6, 3)],
}

SCHEDULE_CASES = [
    *(_case(layout, variant) for layouts in SCHEDULE_LAYOUTS.values() for layout in layouts
      for variant in ("block", "msar")),
    *(_case(layouts[1], "block", cache=False) for layouts in SCHEDULE_LAYOUTS.values()),
]

# Loop placement with the fused backward at P = 3 (blocks of 5 sublayers: every chunk edge but one
# inside a block); the V placement with the split backward and F&B pairs, blocks the variant's own.
VARIANT_LAYOUTS = [("interleaved_1f1b", 3, 2, 3, 6, 5), ("dualpipev", 2, 2, 4, 4, None)]

VARIANT_CASES = [_case(layout, variant, cache=cache) for variant in VARIANTS for layout in VARIANT_LAYOUTS
                 for cache in (True, False)]

# One rank, V chunks of 2 layers with blocks of 2 sublayers: every block closes at a chunk edge, so a
# cached self-hop hands over nothing at all. Then blocks across chunk edges, under GPipe's order too.
ONE_RANK_CASES = [
    *(_case(("interleaved_1f1b", 1, 2, 2, 4, 2), variant, cache=cache) for variant in VARIANTS
      for cache in (True, False)),
    *(_case(layout, variant) for layout in (("gpipe", 1, 4, 2, 4, 4), ("interleaved_1f1b", 1, 3, 2, 3, 3))
      for variant in ("block", "msar")),
    _case(("gpipe", 1, 4, 2, 4, 4), "block", cache=False),
]

# Two ranks, four layers, blocks the variant's own (across chunk edges), two microbatches.
_AC_FUSED, _AC_SPLIT = ("1f1b", 2, 1, 2, 4, None), ("zbv", 2, 2, 2, 4, None)
CHECKPOINT_CASES = [
    *(_case(_AC_SPLIT, variant, policy="full") for variant in VARIANTS),
    *(_case(_AC_FUSED, variant, policy="selective", cache=False) for variant in VARIANTS),
    *(_case(layout, variant, policy=policy, cache=cache) for variant in ("block", "msar")
      for layout, policy, cache in (
          (_AC_FUSED, "full", True),
          (_AC_SPLIT, "selective", False),
          (("interleaved_1f1b", 2, 2, 2, 4, None), "full", False),
          (("interleaved_zb", 2, 2, 2, 4, None), "selective", True),
          (("zb_h1", 2, 1, 2, 4, None), "full", True),
          (("dualpipev", 2, 2, 4, 4, None), "selective", True))),
]

_F64_LOOP, _F64_V = ("interleaved_1f1b", 3, 2, 3, 6, 5), ("dualpipev", 3, 2, 6, 6, 5)
FLOAT64_CASES = [
    *(_case(layout, variant, dtype="float64") for variant in ("block", "lr_projected", "msar")
      for layout in (_F64_LOOP, _F64_V)),
    *(_case(layout, variant, policy=policy, dtype="float64") for variant, layout, policy in (
        ("block", ("interleaved_zb", 3, 2, 3, 6, 5), "none"),
        ("lr_projected", ("zb_h1", 2, 1, 2, 4, None), "full"),
        ("msar", ("interleaved_zb", 2, 2, 2, 4, None), "full"),
        ("msar", ("zbv", 2, 2, 2, 4, None), "selective"),
        ("block", ("1f1b", 2, 1, 2, 4, None), "selective"))),
    # N = 5 blocks over 12 sublayers (sizes 3, 2, 3, 2, 2): boundaries inside chunks and at their edges.
    *(_case(layout, variant, blocks=5, dtype="float64") for variant, layout in (
        ("block", ("interleaved_1f1b", 2, 2, 3, 6, None)),
        ("block", ("1f1b", 3, 1, 3, 6, None)),
        ("msar", ("zbv", 2, 2, 3, 6, None)))),
]

# Tied embeddings need the embedding and the head on one rank: the V layouts (ZB-V, DualPipeV) and P = 1.
_V_LAYOUTS = (("dualpipev", 2, 2, 4, 4, None), ("zbv", 3, 2, 5, 6, 5))
RECIPE_CASES = [
    *(_case(layout, variant, recipe=recipe) for recipe in ("grouped", "legacy") for variant in VARIANTS
      for layout in VARIANT_LAYOUTS),
    *(_case(layout, variant, recipe="mqa-tied") for variant in VARIANTS for layout in _V_LAYOUTS),
    _case(("interleaved_1f1b", 1, 2, 2, 4, 2), "block", recipe="mqa-tied", cache=False),
    *(_case(layout, variant, policy=policy, recipe="grouped") for variant in ("block", "msar")
      for layout, policy in ((_AC_SPLIT, "full"), (_AC_FUSED, "selective"))),
    *(_case(layout, variant, recipe=recipe, dtype="float64") for recipe in ("grouped", "mqa-tied", "legacy")
      for variant, layout in (("block", _V_LAYOUTS[1]), ("lr_projected", _V_LAYOUTS[0]), ("msar", _V_LAYOUTS[1]))),
]

# Tied embeddings with the embedding and the head on two ranks (loop placement) on every loop schedule,
# blocks across chunk edges and not, cached and naive, P = 3, checkpointing, float64; and on the V
# schedules, whose first and last chunks share a rank (one parameter, no embedding group).
_TIED_LOOP = [("1f1b", 2, 1, 3, 4, 4), ("1f1b", 3, 1, 4, 5, 3), ("gpipe", 2, 2, 3, 5, 3),
              ("interleaved_1f1b", 2, 2, 4, 4, 2), ("zb_h1", 3, 1, 4, 6, 2), ("interleaved_zb", 3, 2, 4, 7, 5)]
TIED_CASES = [
    *(_case(layout, variant, recipe="mqa-tied", cache=cache) for layout in _TIED_LOOP
      for variant, cache in (("block", True), ("msar", False))),
    _case(_TIED_LOOP[3], "standard", recipe="mqa-tied"),
    _case(_AC_FUSED, "lr_projected", recipe="mqa-tied", policy="selective"),
    _case(("zb_h1", 2, 1, 2, 4, None), "block", recipe="mqa-tied", policy="full"),
    *(_case(layout, variant, recipe="mqa-tied", dtype="float64") for variant, layout in (
        ("block", _TIED_LOOP[1]), ("msar", _TIED_LOOP[3]), ("lr_sliced", _TIED_LOOP[5]))),
    *(_case(layout, "block", recipe="mqa-tied", cache=False) for layout in (
        *_V_LAYOUTS, ("v_half", 2, 2, 4, 4, 2), ("v_min", 2, 2, 5, 4, 2))),
]

# Mixtures of experts: every variant on the loop and V layouts (the fused and the split backward),
# both checkpointing policies, the one-rank layout, and float64; the sigmoid router on V layouts.
MOE_CASES = [
    *(_case(layout, variant, recipe="moe", cache=cache) for variant in VARIANTS
      for layout, cache in ((VARIANT_LAYOUTS[0], True), (VARIANT_LAYOUTS[1], False))),
    *(_case(layout, variant, policy=policy, recipe="moe") for variant in ("block", "msar")
      for layout, policy in ((_AC_SPLIT, "full"), (_AC_FUSED, "selective"))),
    _case(("interleaved_1f1b", 1, 2, 2, 4, 2), "lr_projected", recipe="moe"),
    *(_case(_V_LAYOUTS[1], variant, recipe="moe-sigmoid") for variant in ("standard", "block", "msar")),
    *(_case(layout, variant, recipe="moe", dtype="float64")
      for variant, layout in (("block", _V_LAYOUTS[1]), ("lr_projected", _F64_LOOP), ("msar", _V_LAYOUTS[0]))),
]

# The controllable-memory V schedules (V-Half, V-Min: the split backward on the V placement, m >= 2P):
# Block AttnRes and MSAR where chunk edges are block edges and where blocks cross them (P = 3),
# cached; Block AttnRes naive; and both under full checkpointing (the W store keeps the
# recomputation's operands from I to W). They join SCHEDULE_CASES, which covers every generator,
# and the split schedules.
SPLIT_SCHEDULES = (*SPLIT_SCHEDULES, "v_half", "v_min")
V_MEMORY_LAYOUTS = {
    "v_half": [("v_half", 2, 2, 4, 4, 2), ("v_half", 3, 2, 6, 6, 5)],
    "v_min": [("v_min", 2, 2, 5, 4, 2), ("v_min", 3, 2, 7, 6, 3)],
}
V_MEMORY_CASES = [
    *(_case(layout, variant) for layouts in V_MEMORY_LAYOUTS.values() for layout in layouts
      for variant in ("block", "msar")),
    *(_case(layouts[1], "block", cache=False) for layouts in V_MEMORY_LAYOUTS.values()),
    _case(("v_min", 2, 2, 4, 4, None), "block", policy="full"),
    _case(("v_half", 2, 2, 4, 4, None), "msar", policy="full", cache=False),
]
SCHEDULE_CASES += V_MEMORY_CASES[:10]

# bf16 autocast under every split schedule (the W store sees through the weights' casts): Block
# AttnRes and MSAR on each schedule's first layout, the MoE recipe on the V and loop placements, and
# full checkpointing (I recomputes under autocast, the store keeps the recomputed bf16 operands).
BF16_SPLIT_CASES = [
    *(_case(SCHEDULE_LAYOUTS[schedule][0], variant, dtype="bfloat16")
      for schedule in ("zb_h1", "interleaved_zb", "zbv", "dualpipev") for variant in ("block", "msar")),
    *(_case(layout, "block", recipe="moe", dtype="bfloat16")
      for layout in (("zbv", 2, 2, 3, 4, None), ("interleaved_zb", 2, 2, 2, 4, None))),
    _case(("dualpipev", 2, 2, 4, 4, None), "standard", recipe="moe", dtype="bfloat16"),
    _case(_AC_SPLIT, "block", policy="full", dtype="bfloat16"),
    _case(("zb_h1", 2, 1, 2, 4, None), "msar", recipe="moe", policy="full", dtype="bfloat16"),
    *(_case(layouts[0], "block", dtype="bfloat16") for layouts in V_MEMORY_LAYOUTS.values()),
]

CASES = list(dict.fromkeys([*SCHEDULE_CASES, *VARIANT_CASES, *ONE_RANK_CASES, *CHECKPOINT_CASES, *FLOAT64_CASES,
                            *RECIPE_CASES, *MOE_CASES, *V_MEMORY_CASES]))
