"""Filling frozen config dataclasses from TOML-like tables: the one place unknown keys and values of
the wrong type are refused, and list values become the tuples the frozen dataclasses hold. Pure
standard library."""

from __future__ import annotations

import dataclasses
import json
import types
import typing


def from_table(cls, values: dict, *, table: str):
    """`cls(**values)` after refusing unknown keys (naming the known ones) and values whose type does not
    match the field's annotation (naming the key, the type expected and the value found). Lists become
    tuples and integers become floats where the field asks for them; the ranges are `cls`'s own checks."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {table} config keys {unknown}; known keys: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _typed(table, name, hints[name], value) for name, value in values.items()})


def to_table(config, *, list_fields: tuple[str, ...] = ()) -> dict:
    """The plain-dict form of a config (tuples back to lists, as TOML and JSON hold them)."""
    out = dataclasses.asdict(config)
    for name in list_fields:
        if out.get(name) is not None:
            out[name] = list(out[name])
    return out


def _typed(table: str, key: str, annotation, value):
    """`value` in the form the field holds, or ValueError saying what was expected and what was found."""
    optional = isinstance(annotation, types.UnionType) and type(None) in typing.get_args(annotation)
    if optional:
        if value is None:
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is tuple:  # tuple[int, ...]: TOML writes a list
        if isinstance(value, list | tuple) and all(_is_int(v) for v in value):
            return tuple(value)
        hint = f"; write {key} = [{value}]" if _is_int(value) else ""
        _refuse(table, key, value, "a list of integers such as [2, 2]", hint)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        _refuse(table, key, value, "true or false (no quotes)", "")
    if annotation is int:
        if _is_int(value):
            return value
        hint = f"; write {key} = {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        _refuse(table, key, value, "an integer", hint or _unquote_hint(key, value, int))
    if annotation is float:
        if _is_int(value) or isinstance(value, float):
            return float(value)
        _refuse(table, key, value, "a number", _unquote_hint(key, value, float))
    if annotation is str:
        if isinstance(value, str):
            return value
        _refuse(table, key, value, "a string in quotes", "")
    return value  # an annotation this module does not know: the dataclass checks it


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unquote_hint(key: str, value, kind: type) -> str:
    """A number written in quotes: suggest it without them."""
    if isinstance(value, str):
        try:
            kind(value)
        except ValueError:
            return ""
        return f"; write {key} = {value.strip()} without quotes"
    return ""


_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
          (list | tuple, "a list"), (dict, "a table"))


def _kind(value) -> str:
    return next((name for kind, name in _KINDS if isinstance(value, kind)), type(value).__name__)


def _refuse(table: str, key: str, value, expected: str, hint: str) -> typing.NoReturn:
    found = _kind(value)
    if isinstance(value, list | tuple):
        found += next((f" holding {_kind(v)}" for v in value if not _is_int(v)), "")
    shown = json.dumps(list(value) if isinstance(value, tuple) else value, default=str)
    raise ValueError(f"[{table}] {key} = {shown} is invalid: expected {expected}, found {found}{hint}")

