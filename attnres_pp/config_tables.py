"""Filling frozen config dataclasses from TOML-like tables: the one place unknown keys are refused
and list values become the tuples the frozen dataclasses hold. Pure standard library."""

from __future__ import annotations

import dataclasses


def from_table(cls, values: dict, *, table: str, tuple_fields: tuple[str, ...] = ()):
    """`cls(**values)` after refusing unknown keys (naming the known ones) and turning lists into tuples."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {table} config keys {unknown}; known keys: {sorted(known)}")
    values = dict(values)
    for name in tuple_fields:
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    return cls(**values)


def to_table(config, *, list_fields: tuple[str, ...] = ()) -> dict:
    """The plain-dict form of a config (tuples back to lists, as TOML and JSON hold them)."""
    out = dataclasses.asdict(config)
    for name in list_fields:
        if out.get(name) is not None:
            out[name] = list(out[name])
    return out
