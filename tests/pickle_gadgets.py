"""Pickle opcodes written by hand, for the tests that attack the checkpoint loader with real gadgets."""

from __future__ import annotations


def text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def stack_global(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"  # STACK_GLOBAL (protocol 4)
