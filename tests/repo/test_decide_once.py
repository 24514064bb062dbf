"""Decide once (docs/architecture.md rule 16): "auto" becomes a device, a dtype or a kernel backend in
one module, `launch.resolve`, whose decisions every engine, rank and command receives as data. Checked
on the source: any other comparison of a device, dtype, precision or kernels value with "auto" is a
second decision, and fails here naming its line."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "attnres_pp"
DECIDER = PACKAGE_ROOT / "launch" / "resolve.py"
DECIDED_NAMES = ("device", "dtype", "precision", "kernels")
# A guard that only asks whether a value was decided, and then hands it to the launch layer.
GUARDS = {("train/stage_worker.py", "run_cfg.train.device")}


def _name(node: ast.AST) -> str:
    return ast.unparse(node)


def _auto_comparisons(path: Path) -> list[tuple[str, int]]:
    """(the compared expression, line) of every `X == "auto"` / `X != "auto"` / `X in (.., "auto")` on a
    device, dtype, precision or kernels value in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        has_auto = any(isinstance(o, ast.Constant) and o.value == "auto" for o in operands)
        for operand in operands:
            name = _name(operand)
            if has_auto and not isinstance(operand, ast.Constant) and name.rsplit(".", 1)[-1].endswith(DECIDED_NAMES):
                found.append((name, node.lineno))
    return found


def test_auto_becomes_a_device_dtype_or_kernels_in_the_launch_layer_only():
    seconds = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if path == DECIDER:
            continue
        relative = path.relative_to(PACKAGE_ROOT).as_posix()
        seconds += [f"{relative}:{line}: {name}" for name, line in _auto_comparisons(path)
                    if (relative, name) not in GUARDS]
    assert not seconds, "decided again outside launch/resolve.py:\n" + "\n".join(seconds)


def test_the_check_finds_a_second_decision(tmp_path):
    """The scan is not vacuous: a module that decides "auto" itself is found."""
    module = tmp_path / "engine.py"
    module.write_text('def pick(train):\n    return "cuda" if train.device == "auto" else train.device\n'
                      'def pick_dtype(dtype, device):\n    return "bf16" if dtype == "auto" and device else dtype\n')
    assert _auto_comparisons(module) == [("train.device", 2), ("dtype", 4)]
    assert _auto_comparisons(DECIDER), "launch/resolve.py decides auto, so the scan must see its comparisons"
