"""Parameter sweeps: communication per step against depth, block count, P and V for the four modes
(from the payload planner), and the unit-cost bubble against m and V (from the event engine).

Each sweep is a `Sweep` (one x axis, one series per mode or schedule) that renders as a Markdown
table and as a PNG line plot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.comm import COMM_MODES, DTYPE_BYTES, comm_report
from attnres_pp.simulator.costs import unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import summarize
from attnres_pp.simulator.plot import plot_lines

_MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Sweep:
    name: str
    title: str
    xlabel: str
    ylabel: str
    x: tuple[int, ...]
    series: dict[str, tuple[float, ...]]
    log_y: bool = False

    def to_markdown(self) -> str:
        header = f"| {self.xlabel} | " + " | ".join(self.series) + " |"
        rule = "|" + "---|" * (len(self.series) + 1)
        rows = [f"| {x} | " + " | ".join(_number(values[i]) for values in self.series.values()) + " |"
                for i, x in enumerate(self.x)]
        return "\n".join([f"### {' '.join(self.title.split())}", f"({self.ylabel})", "", header, rule, *rows])


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"


@dataclass(frozen=True, kw_only=True)
class SweepBase:
    """The point every comm sweep varies one axis around; n_blocks = sublayers / block_size."""

    n_layers: int = 64
    n_blocks: int = 8
    n_stages: int = 4
    n_virtual: int = 2
    n_microbatches: int = 16
    tokens: int = 4096
    d_model: int = 4096
    key_rank: int = 0  # extra width of projected low-rank keys (0: plain AttnRes)
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name, flag, minimum in (("n_layers", "--layers", 1), ("n_blocks", "--blocks", 1),
                                    ("n_stages", "--stages", 1), ("n_virtual", "--virtual", 1),
                                    ("n_microbatches", "--microbatches", 1), ("tokens", "--tokens", 1),
                                    ("d_model", "--d-model", 1), ("key_rank", "--key-rank", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SweepBase.{name}={value!r} is invalid: give {flag} an integer >= {minimum}")
        if (2 * self.n_layers) % self.n_blocks:
            raise ValueError(f"blocks={self.n_blocks} must divide 2 x layers = {2 * self.n_layers} sublayers")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPE_BYTES)}")


def _mib_per_step(base: SweepBase, **overrides) -> dict[str, float]:
    """MiB per training step (m microbatches, both directions) per mode at base + overrides."""
    n_layers = overrides.get("n_layers", base.n_layers)
    n_blocks = overrides.get("n_blocks", base.n_blocks)
    report = comm_report(n_layers=n_layers, block_size=2 * n_layers // n_blocks,
                         n_stages=overrides.get("n_stages", base.n_stages),
                         n_virtual=overrides.get("n_virtual", base.n_virtual), tokens=base.tokens,
                         d_model=base.d_model, source_width=base.d_model + base.key_rank, dtype=base.dtype)
    both = report.bytes_per_microbatch_both_directions
    return {mode: both[mode] * base.n_microbatches / _MIB for mode in COMM_MODES}


def _comm_sweep(base: SweepBase, name: str, axis: str, label: str, values: tuple[int, ...]) -> Sweep:
    points = [_mib_per_step(base, **{axis: v}) for v in values]
    fixed = {"n_layers": f"{base.n_layers} layers", "n_blocks": f"{base.n_blocks} blocks",
             "n_stages": f"P={base.n_stages}", "n_virtual": f"V={base.n_virtual}"}
    fixed.pop(axis)
    return Sweep(name=name, title=f"Communication per step vs {label}\n({', '.join(fixed.values())}, "
                                  f"m={base.n_microbatches}, {base.tokens} tokens/mb, d={base.d_model})",
                 xlabel=label, ylabel="MiB per step, forward + backward", x=values,
                 series={mode: tuple(p[mode] for p in points) for mode in COMM_MODES}, log_y=True)


def comm_vs_depth(base: SweepBase) -> Sweep:
    chunks = base.n_stages * base.n_virtual
    depths = tuple(n for n in (16, 32, 64, 128, 256) if n >= chunks and (2 * n) % base.n_blocks == 0)
    return _comm_sweep(base, "comm_vs_depth", "n_layers", "layers", depths)


def comm_vs_blocks(base: SweepBase) -> Sweep:
    blocks = tuple(n for n in (1, 2, 4, 8, 16, 32, 64, 128) if (2 * base.n_layers) % n == 0
                   and n <= 2 * base.n_layers)
    return _comm_sweep(base, "comm_vs_blocks", "n_blocks", "blocks", blocks)


def comm_vs_stages(base: SweepBase) -> Sweep:
    stages = tuple(p for p in (2, 4, 8, 16, 32) if p * base.n_virtual <= base.n_layers)
    return _comm_sweep(base, "comm_vs_stages", "n_stages", "P (ranks)", stages)


def comm_vs_virtual(base: SweepBase) -> Sweep:
    virtuals = tuple(v for v in (1, 2, 4, 8, 16) if base.n_stages * v <= base.n_layers)
    return _comm_sweep(base, "comm_vs_virtual", "n_virtual", "V (chunks per rank)", virtuals)


def _bubble(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> float:
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    return summarize(simulate(schedule, unit_costs(n_stages, n_virtual)))["bubble_fraction"]


def bubble_vs_microbatches(base: SweepBase) -> Sweep:
    p = base.n_stages
    ms = tuple(p * k for k in (1, 2, 4, 8, 16))
    series = {"gpipe": tuple(_bubble("gpipe", p, 1, m) for m in ms),
              "1f1b": tuple(_bubble("1f1b", p, 1, m) for m in ms)}
    for v in (2, 4):
        series[f"interleaved V={v}"] = tuple(_bubble("interleaved_1f1b", p, v, m) for m in ms)
    return Sweep(name="bubble_vs_microbatches", title=f"Bubble vs microbatches (P={p}, unit costs)",
                 xlabel="m (microbatches)", ylabel="bubble fraction = idle / (ranks x makespan)", x=ms,
                 series=series)


def bubble_vs_virtual(base: SweepBase) -> Sweep:
    p, m = base.n_stages, base.n_microbatches
    vs = (1, 2, 4, 8)
    series = {"interleaved_1f1b": tuple(_bubble("interleaved_1f1b", p, v, m) for v in vs),
              "gpipe": tuple(_bubble("gpipe", p, v, m) for v in vs),
              "closed form (P-1)/(Vm+P-1)": tuple((p - 1) / (v * m + p - 1) for v in vs)}
    return Sweep(name="bubble_vs_virtual", title=f"Bubble vs V (P={p}, m={m}, unit costs)",
                 xlabel="V (chunks per rank)", ylabel="bubble fraction = idle / (ranks x makespan)", x=vs,
                 series=series)


SWEEPS: dict[str, tuple[Callable[[SweepBase], Sweep], ...]] = {
    "comm": (comm_vs_depth, comm_vs_blocks, comm_vs_stages, comm_vs_virtual),
    "bubble": (bubble_vs_microbatches, bubble_vs_virtual),
}


def run_sweeps(base: SweepBase, kinds: tuple[str, ...], out_dir: str | Path | None,
               progress: Callable[[str], None]) -> list[Sweep]:
    """Run the chosen sweeps; with `out_dir`, write NAME.png per sweep and sweeps.md with the tables."""
    results = []
    for kind in kinds:
        for make in SWEEPS[kind]:
            progress(f"sweep {make.__name__} ...")
            sweep = make(base)
            results.append(sweep)
            if out_dir is not None:
                path = plot_lines(Path(out_dir) / f"{sweep.name}.png", x=sweep.x, series=sweep.series,
                                  title=sweep.title, xlabel=sweep.xlabel, ylabel=sweep.ylabel,
                                  log_x=True, log_y=sweep.log_y)
                progress(f"  wrote {path}")
    if out_dir is not None:
        tables = Path(out_dir) / "sweeps.md"
        tables.write_text("\n\n".join(s.to_markdown() for s in results) + "\n")
        progress(f"  wrote {tables}")
    return results
