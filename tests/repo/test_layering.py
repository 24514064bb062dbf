"""The import layering of docs/architecture.md, checked on the source: every `import` (module level or inside a
function) of every module under attnres_pp must point down or sideways, never up.

    kernels, data, config_tables,    import nothing of the project (model: kernels and config_tables)
    out_paths, cli_flags
    comm                             model at most (plan, partition, cache, transports)
    schedule                         comm's partition at most; pure Python, no torch (IR, generators,
                                     passes, validators, timeline accounting, traces)
    pipeline                         schedule, comm and below (runtime, chunks, mesh, stage set-up)
    launch                           pipeline and below (the run decided once, the run flags; rank groups:
                                     processes, Ray, threads, torchrun; the rank host)
    train                            launch and below (configs, optimiser step, engines, checkpoints)
    generate                         train and below (reads checkpoints; generators, decode loop, its CLI)
    analysis                         train and below, beside generate (routing diagnostics, run plots)
    export                           generate and below (a run as a Hugging Face folder; the code it
                                     copies into the folder imports only torch and transformers)
    simulator                        schedule and the torch-free parts of comm; never pipeline, train,
                                     torch, torch.distributed or ray
    bench                            on top: anything

Beside the package, the measurement lab `attnres_lab` (probes, fidelity studies, the fitting of the
simulator's units, the several-hosts harness) may import anything of attnres_pp; attnres_pp never
imports the lab, so the product runs without it and the simulator reads the lab's calibration files,
never its code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "attnres_pp"
LAB_ROOT = PACKAGE_ROOT.parent / "attnres_lab"

# layer -> layers it may import (itself always allowed)
ALLOWED = {
    "config_tables": set(),
    "out_paths": set(),
    "cli_flags": set(),  # the error style and shared flag parsers of every command
    "model_flags": {"cli_flags", "model", "config_tables"},  # the model's flags, for train and simulate
    "kernels": set(),
    "data": set(),
    "model": {"kernels", "config_tables"},
    "comm": {"model", "kernels", "config_tables"},
    "schedule": {"comm"},
    "pipeline": {"schedule", "comm", "model", "kernels", "config_tables", "out_paths"},
    # the run decided once, the run flags, the rank groups and the rank host; training's and generation's
    # workers are handed in as classes
    "launch": {"pipeline", "schedule", "comm", "model", "kernels", "config_tables", "out_paths", "cli_flags",
               "model_flags"},
    "train": {"launch", "pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables", "out_paths",
              "cli_flags", "model_flags"},
    "simulator": {"schedule", "comm", "model", "config_tables", "out_paths", "cli_flags", "model_flags"},
    "generate": {"train", "launch", "pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables",
                 "out_paths", "cli_flags", "model_flags"},
    "analysis": {"train", "launch", "pipeline", "schedule", "comm", "model", "kernels", "data", "config_tables",
                 "out_paths", "cli_flags", "model_flags"},
    "export": {"generate", "train", "launch", "pipeline", "schedule", "comm", "model", "kernels", "data",
               "config_tables", "out_paths", "cli_flags", "model_flags"},
    "bench": {"analysis", "generate", "train", "launch", "simulator", "pipeline", "schedule", "comm", "model",
              "kernels", "data", "config_tables", "out_paths", "cli_flags", "model_flags"},
    "cli": {"cli_flags"},  # imports the subcommands by name, at run time
    "__main__": {"cli"},  # `python -m attnres_pp`: the command line
    "root": set(),  # attnres_pp/__init__.py
}
# The only modules outside its own layer and `schedule` that the simulator may read: the plan, the
# partition and the link model of comm, the model's shapes. All of them are torch-free.
SIMULATOR_MAY_READ = {
    "attnres_pp.comm.plan", "attnres_pp.comm.partition", "attnres_pp.comm.link",
    "attnres_pp.model.config", "attnres_pp.model.weight_store_rule", "attnres_pp.config_tables",
    "attnres_pp.out_paths", "attnres_pp.cli_flags",
    "attnres_pp.model_flags",
}
# The only comm module a schedule may read: where a chunk runs.
SCHEDULE_MAY_READ = {"attnres_pp.comm.partition"}
# Only the Ray rank group and its actor import ray.
RAY_MODULES = {"attnres_pp.launch.ray_rank_group", "attnres_pp.launch.ray_actor"}


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
LAB_MODULES = {_module_name(p): p for p in sorted(LAB_ROOT.rglob("*.py"))}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def _project_imports(module: str) -> list[tuple[str, int]]:
    return [(name, line) for name, line in _imports(MODULES[module]) if name in MODULES]


def test_the_scan_sees_every_layer():
    """Guard against a scan that finds nothing (and so passes vacuously)."""
    layers = {_layer(m) for m in MODULES}
    assert {"model", "kernels", "data", "comm", "schedule", "pipeline", "launch", "train", "simulator",
            "bench"} <= layers
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


def test_the_product_never_imports_the_lab():
    """No module of attnres_pp imports attnres_lab, not even inside a function: the product runs from
    a wheel without the lab's code, and the simulator reads only the files the lab writes."""
    assert len(LAB_MODULES) >= 10, sorted(LAB_MODULES)  # the lab is scanned: a rename would not hide it
    importers = [f"{module} line {line}: imports {name}" for module, path in MODULES.items()
                 for name, line in _imports(path) if name.split(".")[0] == "attnres_lab"]
    assert not importers, "\n".join(importers)


def test_the_lab_reads_the_product_and_nothing_unknown():
    """Every project import of the lab names a module of attnres_pp or of the lab itself (a moved
    module would otherwise leave an import of a name that no longer exists), and the lab does
    import the product (it measures it)."""
    known = set(MODULES) | set(LAB_MODULES)
    unknown, reads_product = [], False
    for module, path in LAB_MODULES.items():
        for name, line in _imports(path):
            top = name.split(".")[0]
            if top in ("attnres_pp", "attnres_lab") and name not in known:
                # `from attnres_pp.x import name`: the module is x (checked), `name` an attribute
                if name.rsplit(".", 1)[0] not in known:
                    unknown.append(f"{module} line {line}: imports {name}")
            reads_product |= top == "attnres_pp"
    assert reads_product
    assert not unknown, "\n".join(unknown)


HARNESS_MODULES = {"attnres_lab.netns_cluster", "attnres_lab.netns_host", "attnres_lab.netns_state"}


def test_the_namespace_harness_needs_nothing_but_the_standard_library():
    """The harness runs as root (`python -m attnres_lab.netns_cluster`): its modules import one
    another and the standard library, nothing else of the project and no third-party package, so
    what it runs is only its own code."""
    import sys

    assert HARNESS_MODULES <= set(LAB_MODULES)
    outside = [f"{module} line {line}: imports {name}" for module in sorted(HARNESS_MODULES)
               for name, line in _imports(LAB_MODULES[module])
               if name.split(".")[0] not in sys.stdlib_module_names
               and name not in HARNESS_MODULES | {"attnres_lab"}
               and name.rsplit(".", 1)[0] not in HARNESS_MODULES]  # `from module import name`
    assert not outside, "\n".join(outside)


def test_no_import_circle_in_the_lab():
    circles = import_circles(LAB_ROOT)
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


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


def _module_imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The project modules that `module` (at `path`) depends on: every import statement, inside
    functions and under `if TYPE_CHECKING:` too (it never runs, but a type named from a module is a
    need of that module: the engine and its replica policies once met that way). `from x import y`
    reaches x.y when that is a module (x is only the way to it), else x. The packages above an
    imported module are not counted: Python has them in sys.modules before their bodies run."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = module.split(".")
                if child.level:  # relative: against this module's package
                    base = base[: len(base) - child.level + (path.name == "__init__.py")]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                names = [f"{source}.{alias.name}" for alias in child.names]
                found.update(name for name in names if name in modules)
                if not all(name in modules for name in names):
                    found.add(source)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return (found & modules) - {module}


def import_circles(root: Path) -> list[list[str]]:
    """Every set of modules of the package at `root` that import one another round in a circle
    (the strongly connected components of the import graph with more than one module), sorted."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {module: _module_imports(path, module, set(paths)) for module, path in paths.items()}
    # Tarjan's algorithm, iterative (no recursion limit on a long chain).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_no_import_circle_in_the_package():
    """No two modules of attnres_pp need each other, directly or round a longer circle. Imports
    inside functions count too: a lazy import defers what an import costs (torch, Ray), not the
    dependency, and a circle of lazy imports still means the modules own one thing between them
    (move it into a third module both import)."""
    circles = import_circles(PACKAGE_ROOT)
    assert not circles, "import circles (move what the modules share into a third one):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_the_circle_checker_finds_a_planted_circle(tmp_path):
    """Two tiny modules that import each other (one at module level, one inside a function, through
    `from pkg import module`) are a circle; a third that only imports them is not in it; a lawful
    chain and a package's own re-export are not circles; a circle closed by a TYPE_CHECKING import is."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import thing\n")
    (package / "a.py").write_text("import pkg.b\n\nthing = 1\n")
    (package / "b.py").write_text("def late():\n    from pkg import a\n    return a.thing\n")
    (package / "c.py").write_text("from pkg import a, b\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import c\n")
    assert import_circles(package) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("import pkg.c\n")
    assert import_circles(package) == [["pkg.a", "pkg.b", "pkg.c"]]
    (package / "b.py").write_text("x = 2\n")
    assert import_circles(package) == []
    (package / "c.py").write_text("import pkg.d\n")  # d names c's types only for the type checker
    assert import_circles(package) == [["pkg.c", "pkg.d"]]


def test_one_module_starts_ray_and_places_ranks():
    """Training and generation start their Ray ranks through one module: it alone calls ray.init
    and makes placement groups."""
    for call in ("ray.init(", "placement_group("):
        callers = {m for m, path in MODULES.items() if call in path.read_text()}
        assert callers == {"attnres_pp.launch.ray_rank_group"}, call


def test_the_product_finds_only_its_own_package_data_by_path():
    """attnres_pp runs from an installed wheel: a module may find a file beside itself (package data,
    `Path(__file__).with_name(...)`), never the checkout above the package (`parents[...]`,
    `.parent.parent`) nor anything under scripts/."""
    import re

    climbing = re.compile(r"__file__.*(\.parents\b|\.parent\.parent|\.\./)")
    found = [f"{module} line {number}: {line.strip()}" for module, path in MODULES.items()
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if climbing.search(line) or re.search(r"[\"'/]scripts/", line)]
    assert not found, "\n".join(found)
    assert climbing.search('HARNESS = Path(__file__).resolve().parents[2] / "scripts"')  # the check itself
