"""`--dp-shard fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the mesh's "dp" dimension, one
unit per transformer layer of the rank's chunks and one each for the embedding and the head; MSAR's
tied stream convolutions stay whole on every rank (`grad_sync` reduces them over every rank).

The pipeline never calls a `TransformerLayer`'s own forward (a chunk runs its sublayers, and a
block's batched depth read uses the pseudo-queries of layers that have not run yet), so FSDP2's
forward and backward hooks never fire; everything is driven through FSDP2's explicit controls:

- MoE's selection bias stays whole on every replica (`_kept_whole`): it is not trained, and
  `moe.update_expert_bias` moves it in place from loads summed over dp;
- under expert parallelism (EP > 1) each MoE sublayer's expert slice is a unit of its own, nested in
  its layer's, sharded over "edp" (`edp_mesh`: the D / EP replicas that hold the same experts)
  instead of dp. Its reduce-scatter sums over those D / EP holders, each of whose unsharded gradients
  already sums its EP group's tokens (the all-to-all's backward brought them), and divides by D
  (`set_gradient_divide_factor`, with sum-only collectives so gloo runs it): the mean over the global
  batch, what `grad_sync.sync_expert_gradients` gives whole slices. At D = EP there is one holder:
  the slice stays whole (`sharded_experts` False) and `grad_sync` keeps it;
- before any compute action of chunk c (F, B, I, W), `unshard()` its units (a no-op when they are
  unsharded already); with `reshard_after_forward="always"`, `reshard()` after each F, so the next
  action of the chunk all-gathers again (the graph's saved parameters are views of the unsharded
  storage, which the all-gather refills);
- gradients accumulate in the unsharded parameters over every microbatch, I and W alike
  (`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)`), so W finds what I left;
- once per step, after the rank's last backward (`reduce`), each unit's reduce-scatter runs once
  (sync switched on, FSDP2's post-backward of the unit's parameter group), averaging over the D
  replicas into the sharded gradients, and the unit reshards. FSDP2 has no public call for "reduce
  now" outside its hooks, so this calls the parameter group's `post_backward` (the same call its
  hooks make) after `_lazy_init` (what its root pre-forward does).

Under `--dtype bf16` each unit gets FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`:
the shards (the master weights), their gradients and AdamW's moments stay fp32, `unshard()` all-gathers
bf16 copies (half the all-gather bytes) that the chunk computes with, and the reduce-scatter runs in
fp32. After each backward action (B, I, W) the unit's `post_backward` with sync off (what FSDP2's hook
does after every backward under no-sync) moves the bf16 gradient into FSDP2's fp32 accumulator, so the
microbatches' gradients add up in fp32, as the replicated run's fp32 `.grad` does. The forward still
runs under autocast (`model.precision`): the ops it keeps in fp32 (norms, depth-attention math, the
loss) then read bf16-rounded weights, where the replicated run's read fp32 ones.

The clipping norm (`grad_norm.norm_reducer`) sums the squares of each rank's local gradient shards over the
ranks whose shards are disjoint (FSDP2's padding rows are zeros) and adds the tied convolutions once.

With tensor parallelism (`train.tp_rank`) the layers are split over tp first and FSDP2 shards the
DTensor weights over dp on top, as torchtitan composes them: a split weight lives on the (dp, tp)
mesh, what every tp rank holds whole on the dp mesh alone. The reduce-scatter averages over dp;
the sum over tp of the sequence shards' partial gradients follows it (`RankTensorParallel.sum_partial_grads`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnres_pp.model.moe import MoE
from attnres_pp.model.precision import PRECISIONS
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.expert_parallel import ExpertSlice
from attnres_pp.schedule.ir import Action


class FsdpShards:
    """The FSDP2 units of one rank and the explicit controls the runtime calls around actions."""

    def __init__(self, model: nn.Module, chunks: dict[int, PipelineChunk], owned_modules: list[str], dp_mesh,
                 reshard_after_forward: str = "never", precision: str = "fp32", edp_mesh=None,
                 data_parallel: int = 1) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # fp32: no policy (FSDP2 computes in the parameters' dtype); bf16: bf16 compute, fp32 reduce.
        mp_policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32) \
            if precision != "fp32" else MixedPrecisionPolicy()
        self.mixed = precision != "fp32"

        self.units: dict[str, nn.Module] = {}
        # Expert slices sharded over "edp" (units of their own, nested in their layers' units).
        self.sharded_experts = edp_mesh is not None and edp_mesh.size() > 1
        self.expert_units: dict[str, nn.Module] = {}
        # FSDP2 refuses 0-dim parameters (MSAR's gate scales): they stay whole and are averaged over
        # the replicas by `grad_sync` like any replicated parameter.
        self.replicated: list[nn.Parameter] = []
        for name in owned_modules:
            if name == "stream_convs":
                continue
            module = model.get_submodule(name)
            scalars = {p for p in module.parameters() if p.dim() == 0}
            self.replicated += sorted(scalars, key=lambda p: [id(q) for q in module.parameters()].index(id(p)))
            if self.sharded_experts:
                self.expert_units.update(_shard_expert_slices(name, module, edp_mesh, mp_policy, data_parallel))
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False,
                        ignored_params=(scalars | _kept_whole(module, self.sharded_experts)) or None,
                        mp_policy=mp_policy, shard_placement_fn=shard_placement)
            module._get_fsdp_state()._lazy_init()  # the root of its nested expert units too
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
            self.units[name] = module
        self.units_of: dict[int, list[nn.Module]] = {}
        for c, chunk in chunks.items():
            names = [f"layers.{i}" for i in chunk.layers]
            if chunk.is_first:
                names.insert(0, "embed")
            if chunk.is_last:
                names.append("head")
            self.units_of[c] = [self.units[n] for n in names]
            self.units_of[c] += [unit for n in names for name, unit in self.expert_units.items()
                                 if name.startswith(n + ".")]
        self.reshard_after_forward = reshard_after_forward == "always"

    def before(self, action: Action) -> None:
        for unit in self.units_of[action.chunk_index]:
            unit.unshard()

    def after(self, action: Action) -> None:
        if self.reshard_after_forward and action.kind.name == "F":
            for unit in self.units_of[action.chunk_index]:
                unit.reshard()
        elif self.mixed and action.kind.name != "F":
            for unit in self.units_of[action.chunk_index]:  # bf16 .grad -> FSDP2's fp32 accumulator
                unit._get_fsdp_state()._fsdp_param_group.post_backward()

    def reduce(self) -> None:
        """Each unit's reduce-scatter, once, after the step's last backward; then reshard. Every
        member of a unit's group calls them in the same order: the layers' (over dp), then the
        expert slices' (over edp)."""
        for unit in [*self.units.values(), *self.expert_units.values()]:
            unit.unshard()  # the unsharded gradients live on the unsharded parameters
            if unit in self.expert_units.values():
                _zero_missing_grads(unit)
            unit.set_requires_gradient_sync(True)
            group = unit._get_fsdp_state()._fsdp_param_group
            group.post_backward()
            group.finalize_backward()  # waits for the reduce-scatter and clears the group's state
            unit.set_requires_gradient_sync(False)
            unit.reshard()


def _kept_whole(module: nn.Module, sharded_experts: bool) -> set[nn.Parameter]:
    """What the dp unit of `module` leaves alone besides scalars: MoE's selection bias, which the
    optimiser never touches and `moe.update_expert_bias` moves in place, equal on every replica; and
    expert parallelism's expert slices, which are either units of their own over "edp"
    (`sharded_experts`: FSDP2 skips a nested unit's parameters by itself) or whole, summed by their
    holders over "edp" (`grad_sync.sync_expert_gradients`)."""
    kept: set[nn.Parameter] = set()
    for moe in (m for m in module.modules() if isinstance(m, MoE)):
        kept.add(moe.expert_bias)
        if isinstance(moe.experts, ExpertSlice) and not sharded_experts:
            kept |= set(moe.experts.parameters())
    return kept


def _shard_expert_slices(name: str, module: nn.Module, edp_mesh, mp_policy, data_parallel: int
                         ) -> dict[str, nn.Module]:
    """FSDP2 units over "edp" for the expert slices in `module` (whole-model name `name`), by whole-model
    name. Their gradient is divided by D, not by the D / EP members of edp (see the module's text);
    FSDP2's forward hooks are removed: the pipeline drives every unit explicitly, and MoE calls its
    experts as a module, which would fire them."""
    from torch.distributed.fsdp import fully_shard

    units = {}
    for sub, moe in ((n, m) for n, m in module.named_modules() if isinstance(m, MoE)):
        if not isinstance(moe.experts, ExpertSlice):
            continue
        experts = moe.experts
        fully_shard(experts, mesh=edp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
        state = experts._get_fsdp_state()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        experts.set_force_sum_reduction_for_comms(True)  # a sum, then / D: no PREMUL_SUM (gloo has none)
        experts.set_gradient_divide_factor(float(data_parallel))
        experts.set_requires_gradient_sync(False)
        experts.set_reshard_after_backward(False)
        units[f"{name}.{sub}.experts" if sub else f"{name}.experts"] = experts
    return units


def _zero_missing_grads(unit: nn.Module) -> None:
    """Zeros for the unsharded gradients of an expert unit whose slice got no token this step, so
    every edp member joins the reduce-scatter with the same layout (and AdamW steps the slice, as the
    single process steps every row of the whole expert tensor)."""
    for fsdp_param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
        param = fsdp_param.unsharded_param
        if param.grad is None and fsdp_param.unsharded_accumulated_grad is None:
            param.grad = torch.zeros_like(param)


def shard_placement(param: nn.Parameter):
    """FSDP2's placement over dp for `param`: its columns (`Shard(1)`) for the fused qkv weight that
    tensor parallelism splits with `_StridedShard(0)` (its heads' q, k and v rows), FSDP2's default
    rows for the rest. On the same rows, FSDP2 would cut the tp rank's local rows into D pieces and
    describe them as `(_StridedShard(0), _StridedShard(0))`, a layout DTensor does not read back:
    `full_tensor()` returned wrongly ordered rows (measured on two replicas of two tp ranks), and
    checkpoints save the weight through it (`tp_rank.whole_strided`). Columns keep the two splits on
    different dimensions. They must divide evenly: `launch.resolve.check_tensor_parallel`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = getattr(param, "placements", ())
    if any(isinstance(p, _StridedShard) and p.dim == 0 for p in placements):
        return Shard(1)
    return None
