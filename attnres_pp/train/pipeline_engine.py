"""Pipelined training engines (the `Engine` protocol of `attnres_pp.train.loop`) shared pieces:
step accounting, trace writing and evaluation on the gathered whole model."""

from __future__ import annotations

from pathlib import Path

import torch

from attnres_pp.model import Transformer, parameter_count
from attnres_pp.pipeline.trace import write_chrome_trace
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.step_stats import StepStatsLog


class PipelineEngineBase:
    """Turns per-rank step results into a StepResult; writes DIR/trace.json for one step."""

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None) -> None:
        self.run_cfg = run_cfg
        self.out_dir = Path(out_dir) if out_dir is not None else None
        pipe = run_cfg.pipeline
        self.stats = StepStatsLog(n_ranks=pipe.stages, n_chunks=pipe.n_chunks)
        # The second step is the first one free of warm-up effects; a 1-step run traces step 0.
        self._trace_step = min(1, run_cfg.train.steps - 1)

    @property
    def train_cfg(self):
        """The run's TrainConfig with device, dtype and kernels resolved (summary.json's config)."""
        return self.run_cfg.train

    def param_count(self) -> int:
        return parameter_count(self.run_cfg.model)

    def _step_result(self, step: int, rank_results: list[dict]) -> StepResult:
        loss, extras, metrics = self.stats.add(rank_results, self.run_cfg.train.microbatches)
        if self.out_dir is not None and step == self._trace_step:
            trace = write_chrome_trace(sorted(self.stats.last_events, key=lambda e: e[2]), self.out_dir / "trace.json")
            extras["trace"] = str(trace)
        return StepResult(loss=loss, extras=extras, metrics=metrics)


def model_from_parameters(run_cfg: RunConfig, named: dict[str, torch.Tensor]) -> Transformer:
    """A whole single-process model carrying the pipeline's current parameters (for evaluation, on
    CPU, in the run's precision)."""
    precision = run_cfg.train.dtype if run_cfg.train.dtype != "auto" else "fp32"
    model = Transformer(run_cfg.model, precision=precision)
    missing = set(dict(model.named_parameters())) - set(named)
    if missing:
        raise RuntimeError(f"the pipeline ranks returned no values for parameters {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(named[name])
    return model.eval()
