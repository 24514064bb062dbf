"""Numeric flags of the `simulate plan` and `simulate project` commands, parsed by the command rather
than by argparse, so that a bad value is one `... error: ...` line (exit 2) naming the flag and what
it expects. A table row is (flag, dest, type, default, help); `required` names the flags that must
be given (their default is not used)."""

from __future__ import annotations

import argparse
import math

NumberFlag = tuple[str, str, type, object, str]


def add_number_flags(parser: argparse.ArgumentParser, table: tuple[NumberFlag, ...], required: tuple[str, ...]) -> None:
    for flag, dest, _kind, default, help_text in table:
        parser.add_argument(flag, dest=dest, metavar="N", default=None,
                            help=help_text + ("" if default is None else f" (default {default:g})")
                            + (" [required]" if flag in required else ""))


def parse_number_flags(args: argparse.Namespace, table: tuple[NumberFlag, ...], required: tuple[str, ...], *,
                       positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> dict:
    """{dest: value} for every row: the given value, or the default. Values must be finite; flags in
    `positive` must be > 0 and flags in `non_negative` >= 0."""
    values = {}
    for flag, dest, kind, default, _help in table:
        raw = getattr(args, dest)
        if raw is None:
            if flag in required:
                raise ValueError(f"{flag} is required")
            values[dest] = default
            continue
        try:
            value = kind(raw)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise ValueError(f"{flag} {raw!r} is invalid: expected {expected}") from None
        bound = " > 0" if flag in positive else " >= 0" if flag in non_negative else ""
        if not math.isfinite(value) or (flag in positive and value <= 0) or (flag in non_negative and value < 0):
            raise ValueError(f"{flag} {raw!r} is invalid: expected a finite number{bound}")
        values[dest] = value
    return values
