"""The import layering of docs/architecture.md, checked on the source: every `import` (module level or inside a
function) of every module under attnres_pp must point down or sideways, never up.

    kernels, data, config_tables,    import nothing of the project (model: kernels and config_tables)
    out_paths
    comm                             model at most (plan, partition, cache, transports)
    schedule                         comm's partition at most; pure Python, no torch (IR, generators,
                                     passes, validators, timeline accounting, traces)
    pipeline                         schedule, comm and below (runtime, chunks, rank start-up)
    train                            pipeline and below (configs, optimiser step, engines, checkpoints)
    generate                         train and below (reads checkpoints; generators, decode loop, its CLI)
    analysis                         train and below, beside generate (routing diagnostics, run plots)
    simulator                        schedule and the torch-free parts of comm; never pipeline, train,
                                     torch, torch.distributed or ray
    bench                            on top: anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "attnres_pp"

# layer -> layers it may import (itself always allowed)
ALLOWED = {
    "config_tables": set(),
    "out_paths": set(),
    "kernels": set(),
    "data": set(),
    "model": {"kernels", "config_tables"},
    "comm": {"model", "kernels", "config_tables"},
    "schedule": {"comm"},
    "pipeline": {"schedule", "comm", "model", "kernels", "config_tables", "out_paths"},
    "train": {"pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables", "out_paths"},
    "simulator": {"schedule", "comm", "model", "config_tables", "out_paths"},
    "generate": {"train", "pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables", "out_paths"},
    "analysis": {"train", "pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables", "out_paths"},
    "bench": {"analysis", "generate", "train", "simulator", "pipeline", "schedule", "comm", "model", "kernels", "data",
              "config_tables", "out_paths"},
    "cli": set(),  # imports the subcommands by name, at run time
    "root": set(),  # attnres_pp/__init__.py
}
# The only modules outside its own layer and `schedule` that the simulator may read: the plan, the
# partition and the link model of comm, the model's shapes. All of them are torch-free.
SIMULATOR_MAY_READ = {
    "attnres_pp.comm.plan", "attnres_pp.comm.partition", "attnres_pp.comm.link",
    "attnres_pp.model.config", "attnres_pp.config_tables", "attnres_pp.out_paths",
}
# The only comm module a schedule may read: where a chunk runs.
SCHEDULE_MAY_READ = {"attnres_pp.comm.partition"}
RAY_MODULES = {"attnres_pp.train.ray_engine", "attnres_pp.generate.ray_generator"}  # only the Ray launchers


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = _module_name(path).split(".")
                base = base[: len(base) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            # `from attnres_pp.kernels import triton_ops` imports a module too
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def _project_imports(module: str) -> list[tuple[str, int]]:
    return [(name, line) for name, line in _imports(MODULES[module]) if name in MODULES]


def test_the_scan_sees_every_layer():
    """Guard against a scan that finds nothing (and so passes vacuously)."""
    layers = {_layer(m) for m in MODULES}
    assert {"model", "kernels", "data", "comm", "schedule", "pipeline", "train", "simulator", "bench"} <= layers
    assert sum(len(_project_imports(m)) for m in MODULES) > 100


def _uphill(module: str, imports: list[tuple[str, int]]) -> list[str]:
    """The imports of `module` that break the layering, one line each."""
    layer = _layer(module)
    allowed = ALLOWED[layer] | {layer}
    return [f"line {line}: imports {name} (layer {_layer(name)})"
            for name, line in imports if _layer(name) not in allowed]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    uphill = _uphill(module, _project_imports(module))
    allowed = sorted(ALLOWED[_layer(module)] | {_layer(module)})
    assert not uphill, f"{module} (layer {_layer(module)}) may import only {allowed}:\n" + "\n".join(uphill)


def test_a_reversed_import_between_schedule_and_pipeline_fails():
    """The checker itself: a schedule module reading the runtime, or the simulator reading the
    pipeline, is reported; the lawful direction is not."""
    assert _uphill("attnres_pp.schedule.validate", [("attnres_pp.pipeline.runtime", 7)])
    assert _uphill("attnres_pp.simulator.engine", [("attnres_pp.pipeline.chunk", 3)])
    assert _uphill("attnres_pp.schedule.ir", [("attnres_pp.train.loop", 1)])
    assert not _uphill("attnres_pp.pipeline.runtime", [("attnres_pp.schedule.ir", 1)])
    assert not _uphill("attnres_pp.simulator.engine", [("attnres_pp.schedule.validate", 1)])


def test_schedule_is_pure_python():
    """The schedule package imports no torch, no ray, no numpy, and of comm only the partition."""
    problems = []
    for module in (m for m in MODULES if _layer(m) == "schedule"):
        for name, line in _imports(MODULES[module]):
            if name.split(".")[0] in ("torch", "ray", "numpy", "triton"):
                problems.append(f"{module} line {line}: imports {name}")
            if name in MODULES and _layer(name) == "comm" and name not in SCHEDULE_MAY_READ:
                problems.append(f"{module} line {line}: reads {name}; schedule may read only {SCHEDULE_MAY_READ}")
    assert sum(1 for m in MODULES if _layer(m) == "schedule") >= 9
    assert not problems, "\n".join(problems)


def test_the_simulator_reads_only_torch_free_modules():
    """Every project module the simulator reaches (transitively) is on the list, and none of them,
    nor the simulator itself, imports torch, torch.distributed or ray."""
    todo = [m for m in MODULES if _layer(m) == "simulator"]
    seen: set[str] = set()
    problems = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name, line in _imports(MODULES[module]):
            top = name.split(".")[0]
            if top in ("torch", "ray"):
                problems.append(f"{module} line {line}: imports {name}")
            if name in MODULES:
                if _layer(name) not in ("simulator", "schedule") and name not in SIMULATOR_MAY_READ \
                        and name != "attnres_pp":
                    problems.append(f"{module} line {line}: reads {name}, which the simulator may not")
                todo.append(name)
    assert len(seen) > 10
    assert not problems, "\n".join(problems)


def test_only_the_ray_launcher_imports_ray():
    importers = {m for m in MODULES for name, _ in _imports(MODULES[m]) if name.split(".")[0] == "ray"}
    assert importers == RAY_MODULES
