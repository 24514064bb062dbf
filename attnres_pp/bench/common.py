"""What the benchmarks share: the benchmark model, run configs, a pipelined engine stepped one timed
global batch at a time, the per-action time accounting of a step, and the one results writer every
benchmark goes through: the machine description and its line, the recorded command, the stem
`<name>[_quick]_<YYYY-MM-DD>` and the files STEM.json and STEM.md under `benchmarks/results/` of the
working directory. Nothing here looks for the source checkout: the benchmarks run from an installed wheel.
The time accounting of a step lives in `attnres_pp.schedule.timeline`.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnres_pp.schedule.timeline import Event, account, message_pairs  # noqa: F401  (re-exported)
from attnres_pp.train.config import RunConfig

# Big enough that F/B compute dominates Python dispatch on one CPU core, small enough that every
# `--quick` benchmark finishes in minutes on 2 cores.
BENCH_MODEL = {"vocab_size": 256, "n_layers": 8, "d_model": 128, "n_heads": 4, "seq_len": 64}
MICROBATCH_SIZE = 4  # sequences per microbatch


def default_out_dir() -> Path:
    """`benchmarks/results/` under the working directory (a checkout's own folder when run from its root)."""
    return Path.cwd() / "benchmarks" / "results"


def run_config(model: dict, *, stages: int, virtual: int, schedule: str, microbatches: int,
               microbatch_size: int = MICROBATCH_SIZE, cache: bool = True, launcher: str = "local",
               threads: int = 1, seed: int = 0) -> RunConfig:
    """A validated RunConfig for a benchmark run (no warm-up of the learning rate: lr is constant)."""
    return RunConfig.from_dict({
        "model": dict(model),
        "train": {"steps": 10_000, "batch_size": microbatch_size * microbatches, "microbatches": microbatches,
                  "warmup_steps": 0, "seed": seed, "threads": threads},
        "pipeline": {"stages": stages, "virtual": virtual, "schedule": schedule, "cache": cache,
                     "launcher": launcher, "timeout_s": 120.0},
    })


def random_batch(step: int, batch_size: int, seq_len: int, vocab_size: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[batch_size, seq_len]` (inputs, targets), a pure function of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass
class StepSample:
    """One timed optimiser step: driver wall time (pipeline + optimiser + pipes) and the pipeline's events."""

    wall_s: float
    events: list[Event]
    bytes_sent: int
    loss: float
    metrics: dict | None = None  # the step's metrics.jsonl record (`StepResult.metrics`)


@dataclass
class TimedEngine:
    """A pipelined engine (`make_pipeline_engine`) stepped one random global batch at a time."""

    run_cfg: RunConfig
    samples: list[StepSample] = field(default_factory=list)
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        from attnres_pp.train.engines import make_pipeline_engine

        started = time.perf_counter()
        self.engine = make_pipeline_engine(self.run_cfg, None, record_timelines=True)  # every step's timeline
        self.startup_s = time.perf_counter() - started

    def step(self) -> StepSample:
        cfg, train = self.run_cfg.model, self.run_cfg.train
        step = len(self.samples)
        inputs_BT, targets_BT = random_batch(step, train.batch_size, cfg.seq_len, cfg.vocab_size, train.seed)
        started = time.perf_counter()
        result = self.engine.train_step(step, inputs_BT, targets_BT, 1e-3)
        wall_s = time.perf_counter() - started
        sample = StepSample(wall_s, list(self.engine.stats.last_events), int(result.extras["bytes_sent_per_step"]),
                            float(result.loss), dict(result.metrics))
        self.samples.append(sample)
        return sample

    def close(self) -> None:
        self.engine.close()


def median_accounting(samples: list[StepSample], n_ranks: int) -> dict[str, float]:
    """The median of every `account` figure over steps (each figure's own median)."""
    rows = [account(s.events, n_ranks) for s in samples]
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def median_sample(samples: list[StepSample], n_ranks: int) -> StepSample:
    """The step whose pipeline window is the median one (its timeline represents the run)."""
    ordered = sorted(samples, key=lambda s: account(s.events, n_ranks)["step_s"])
    return ordered[len(ordered) // 2]


def analytic_bubble(schedule: str, n_stages: int, n_virtual: int, n_microbatches: int) -> dict[str, float]:
    """docs/spec.md section 5 with equal chunk times: idle over the ideal (P-1)/(k V m) and as a fraction of the
    step (P-1)/(k V m + P-1), k = 3 for the split-backward schedules (ZB-H1's published figure and
    its interleaved and V-shaped kin), 1 otherwise. GPipe with V > 1 runs breadth first, so V
    divides its bubble too."""
    from attnres_pp.simulator.metrics import closed_form_bubble_fraction, closed_form_bubble_ratio

    return {"fraction": closed_form_bubble_fraction(n_stages, n_virtual, n_microbatches, schedule),
            "ratio": closed_form_bubble_ratio(n_stages, n_virtual, n_microbatches, schedule)}


def machine() -> dict:
    """Where a benchmark ran (written next to every result)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in load],
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line(info: dict) -> str:
    return (f"{info['cpu_count']} x {info['cpu_model']}, {info['platform']}, Python {info['python']}, "
            f"torch {info['torch']}; load average at start {info['load_average_at_start']}")


def results_stem(name: str, quick: bool, suffix: str = "") -> str:
    """NAME[_quick]_<YYYY-MM-DD>SUFFIX: the stem of a benchmark's result files (`suffix` for the
    benchmarks whose names carry their tags after the date, `quality_<date>_partial`)."""
    return f"{name}{'_quick' if quick else ''}_{datetime.date.today().isoformat()}{suffix}"


def repo_relative(value, root: str | Path | None = None):
    """`value` (a payload: dicts, lists, strings) with every absolute path inside `root` (default:
    the working directory, a checkout's root when run from there) written relative to it: results
    are committed, and a path of one machine's checkout means nothing in another clone."""
    prefix = f"{Path(root or Path.cwd()).resolve()}/"
    if isinstance(value, str):
        return value.replace(prefix, "")
    if isinstance(value, dict):
        return {key: repo_relative(item, prefix) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [repo_relative(item, prefix) for item in value]
    return value


def write_results(out_dir: str | Path, stem: str, payload: dict, markdown: str) -> list[Path]:
    """Write STEM.json and STEM.md under `out_dir`, paths inside the working directory made relative
    to it (`repo_relative`); returns their paths."""
    from attnres_pp.train.summary import write_json_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json_atomic(json_path, repo_relative(payload))  # strict JSON: non-finite floats become null
    md_path.write_text(repo_relative(markdown).rstrip() + "\n")
    return [json_path, md_path]


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def relative_link(path: str | Path) -> str:
    """A picture's link from STEM.md: pictures live in the folder STEM/ beside it."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}"


def command_line(name: str, flags: list[str], program: tuple[str, ...] = ("attnres-pp", "bench")) -> str:
    """The `attnres-pp bench NAME FLAGS...` command (or another `program`'s) recorded with a result,
    quoted for a shell."""
    return shlex.join([*program, name, *flags])
