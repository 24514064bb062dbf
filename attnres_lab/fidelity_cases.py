"""The runs of `attnres-lab fidelity` as data: a `Case` (schedule, V, m, payload mode, layers, link) and
the model, shape and run config it stands for. `attnres_lab.fidelity` (emulated links) and
`attnres_lab.fidelity_hosts` (real links between hosts) both build their runs from it.
"""

from __future__ import annotations

import dataclasses

from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, run_config
from attnres_pp.comm.link import LinkModel
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.transfer import RunShape

N_STAGES = 2
BLOCK_SIZE = 4  # sublayers: blocks of 2 layers
SLOW_LINK_GBPS = 0.2


@dataclasses.dataclass(frozen=True)
class Case:
    schedule: str
    virtual: int
    microbatches: int
    mode: str  # standard | naive | cached
    layers: int
    link_gbps: float | None = None

    def model(self) -> dict:
        if self.mode == "standard":
            return {**BENCH_MODEL, "n_layers": self.layers, "residual": "standard", "block_size": 1}
        return {**BENCH_MODEL, "n_layers": self.layers, "residual": "attnres", "block_size": BLOCK_SIZE}

    def shape(self) -> RunShape:
        return RunShape(model=ModelConfig.from_dict(self.model()), schedule=self.schedule, n_stages=N_STAGES,
                        n_virtual=self.virtual, n_microbatches=self.microbatches, microbatch_size=MICROBATCH_SIZE,
                        cache=self.mode == "cached",
                        link=LinkModel(gbps=self.link_gbps) if self.link_gbps is not None else None)

    def run_config(self):
        run_cfg = run_config(self.model(), stages=N_STAGES, virtual=self.virtual, schedule=self.schedule,
                             microbatches=self.microbatches, cache=self.mode == "cached")
        if self.link_gbps is None:
            return run_cfg
        return dataclasses.replace(run_cfg, pipeline=dataclasses.replace(run_cfg.pipeline, link_gbps=self.link_gbps))

    def label(self) -> str:
        link = f" @{self.link_gbps:g}Gb/s" if self.link_gbps is not None else ""
        return f"{self.schedule} V={self.virtual} m={self.microbatches} {self.mode} L={self.layers}{link}"

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "P": N_STAGES, "V": self.virtual, "m": self.microbatches,
                "mode": self.mode, "layers": self.layers}
