"""The aux-free balancing a rank runs after each optimiser step (docs/spec.md section 12): its MoE
sublayers' loads of the step summed over the replicas that routed the same layers' tokens, the bias
moved from them, and the step's aux losses and all-to-alls reported to the driver. A mixin of the
rank workers (StageWorker, and FtWorker, which sums the loads through its replica groups' Manager)."""

from __future__ import annotations

import torch

from attnres_pp.model.moe import moe_sublayers, take_aux, take_loads, update_expert_bias
from attnres_pp.pipeline.expert_parallel import take_exchange


class ExpertBalance:
    """Needs the worker's `model`, `run_cfg`, `device`, `collectives` and `tp`."""

    def balance_experts(self) -> dict | None:
        """After the optimiser step: this rank's MoE sublayers' loads of the step, summed over the
        data-parallel group (every replica then moves its aux-free bias the same way), its aux
        losses and, under expert parallelism, its all-to-alls' seconds and bytes; None without MoE
        sublayers."""
        moes = moe_sublayers(self.model)
        if not moes:
            return None
        loads_LE = self.step_loads(moes)
        update_expert_bias(moes, loads_LE)
        aux_sum, aux_count = take_aux(moes)
        report = {"loads": {name: load_E.tolist() for name, load_E in zip(moes, loads_LE, strict=True)},
                  "aux_sum": aux_sum, "aux_count": aux_count}
        if self.run_cfg.pipeline.expert_parallel > 1:  # the step's dispatch and combine, timed and counted
            report["all_to_all_s"], report["all_to_all_bytes"] = take_exchange(self.model)
        return report

    def step_loads(self, moes: dict) -> torch.Tensor:
        """`[layers, E]`: the step's token-choices per expert of `moes`, summed over the replicas."""
        loads_LE = take_loads(moes)
        # Under sequence parallelism each tp rank routed its own shard of the tokens.
        axes = ["dp"] * (self.run_cfg.pipeline.data_parallel > 1) + ["tp"] * self.tp.sp
        if axes:
            on_device = loads_LE.to(self.device)
            for axis in axes:
                self.collectives.all_reduce(on_device, axis)
            loads_LE = on_device.cpu()
        return loads_LE
