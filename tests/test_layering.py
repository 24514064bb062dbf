"""The import layering of DESIGN.md, checked on the source: every `import` (module level or inside a
function) of every module under attnres_pp must point down or sideways, never up.

    kernels, data, config_tables,    import nothing of the project (model: kernels and config_tables)
    out_paths
    comm                             model at most (plan, partition, cache, transports)
    pipeline                         comm and below
    train                            pipeline and below (configs, optimiser step, engines, checkpoints)
    generate                         train and below (reads checkpoints; generators, decode loop, its CLI)
    simulator                        the torch-free parts of pipeline and comm; never the runtime, train,
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
    "pipeline": {"comm", "model", "kernels", "config_tables", "out_paths"},
    "train": {"pipeline", "comm", "model", "kernels", "data", "config_tables", "out_paths"},
    "simulator": {"pipeline", "comm", "model", "config_tables", "out_paths"},
    "generate": {"train", "pipeline", "comm", "model", "kernels", "data", "config_tables", "out_paths"},
    "bench": {"generate", "train", "simulator", "pipeline", "comm", "model", "kernels", "data", "config_tables",
              "out_paths"},
    "cli": set(),  # imports the subcommands by name, at run time
    "root": set(),  # attnres_pp/__init__.py
}
# The only pipeline / comm modules the simulator may read: the schedule IR, passes and validator,
# the timeline accounting and traces, the plan and the partition. All of them are torch-free.
SIMULATOR_MAY_READ = {
    "attnres_pp.pipeline.ir", "attnres_pp.pipeline.schedules", "attnres_pp.pipeline.passes",
    "attnres_pp.pipeline.validate", "attnres_pp.pipeline.validate_nccl", "attnres_pp.pipeline.timeline",
    "attnres_pp.pipeline.trace",
    "attnres_pp.pipeline.config", "attnres_pp.comm.plan", "attnres_pp.comm.partition", "attnres_pp.comm.link",
    "attnres_pp.model.config", "attnres_pp.config_tables", "attnres_pp.out_paths",
}
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
    assert {"model", "kernels", "data", "comm", "pipeline", "train", "simulator", "bench"} <= layers
    assert sum(len(_project_imports(m)) for m in MODULES) > 100


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    layer = _layer(module)
    allowed = ALLOWED[layer] | {layer}
    uphill = [f"line {line}: imports {name} (layer {_layer(name)})"
              for name, line in _project_imports(module) if _layer(name) not in allowed]
    assert not uphill, f"{module} (layer {layer}) may import only {sorted(allowed)}:\n" + "\n".join(uphill)


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
                if _layer(name) != "simulator" and name not in SIMULATOR_MAY_READ and name != "attnres_pp":
                    problems.append(f"{module} line {line}: reads {name}, which the simulator may not")
                todo.append(name)
    assert len(seen) > 10
    assert not problems, "\n".join(problems)


def test_only_the_ray_launcher_imports_ray():
    importers = {m for m in MODULES for name, _ in _imports(MODULES[m]) if name.split(".")[0] == "ray"}
    assert importers == RAY_MODULES
