"""The kernel rules that hold for the source, whatever the device: no atomics anywhere in the Triton
kernels (gradient sums are written as per-program partials and summed in a fixed order, so a
backward is bitwise deterministic), checked on the syntax tree of every kernel module.

The bitwise-determinism tests themselves (tests/kernels/test_triton_interpreter.py and
test_triton_msar_streams.py) run where they can fail: on a GPU, where programs run concurrently.
The CPU interpreter runs the programs of a launch one after another in a fixed order, so on CPU
two runs are equal whatever the kernel does; this check is what can fail there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attnres_pp.kernels

KERNEL_DIR = Path(attnres_pp.kernels.__file__).parent


def atomic_calls(source: str) -> list[str]:
    """`name:line` of every call to an attribute named atomic_* (tl.atomic_add, triton.language.atomic_cas ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("atomic"):
            found.append(f"{node.func.attr}:{node.lineno}")
    return found


def test_the_check_finds_atomics_however_they_are_spelled():
    planted = """
import triton.language as tl
import triton.language as language

def kernel(ptr, value):
    tl.atomic_add(ptr, value)
    language.atomic_max(ptr + 1, value)
    tl.atomic_cas(ptr, 0, 1)
"""
    assert atomic_calls(planted) == ["atomic_add:6", "atomic_max:7", "atomic_cas:8"]
    assert atomic_calls("def f(x):\n    return x.atomicity + 1\n") == []  # an attribute, not a call


@pytest.mark.parametrize("module", sorted(p.name for p in KERNEL_DIR.glob("triton_*.py")))
def test_no_triton_kernel_uses_atomics(module):
    assert atomic_calls((KERNEL_DIR / module).read_text()) == []
