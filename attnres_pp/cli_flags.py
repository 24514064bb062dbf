"""The command line's one error style and its shared flag parsers, for every `attnres-pp` command.

A refusal is one line `error: <what to change>` on stderr and exit code 2, whether argparse finds
the mistake (`ArgumentParser`, the class of the top-level parser and so of every subcommand's) or the
command does (`refuse`). Numbers arrive as text and are converted here, so a bad value names its flag:
`convert_flag` (int, float or str), `number_flag` (with a finite bound), `number_type` (the same check
as an argparse `type=`), the flag tables of `add_number_flags` / `parse_number_flags`, and
`layer_counts` for `--layer-counts`. Pure standard library: the simulator and the bench read it too.
"""

from __future__ import annotations

import argparse
import math
import sys
import typing

# The bounds a number flag may carry: none (any finite number), "> 0" or ">= 0". A misspelt bound is
# a KeyError (a bug to fix), never a user's `error:` line.
_WITHIN = {"": lambda value: True, "> 0": lambda value: value > 0, ">= 0": lambda value: value >= 0}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors read `error: <message>; see PROG --help` (one line, exit 2)
    like every other refusal, without the usage text (train's alone is 30 lines), which `--help`
    prints. Subparsers made by `add_subparsers` inherit the class."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def refuse(error: Exception | str, *, full: bool = False) -> int:
    """Print `error: <message>` on stderr and return exit code 2: the message's first line, or with
    `full` all of it (a ScheduleError's per-rank table follows its first line)."""
    message = str(error)
    print(f"error: {message if full else (message.splitlines() or [''])[0]}", file=sys.stderr)
    return 2


def convert_flag(flag: str, raw: str, kind: type):
    """A command-line flag's text as `kind` (int, float, str); ValueError naming the flag otherwise."""
    try:
        return kind(raw)
    except ValueError:
        expected = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ValueError(f"{flag} {raw!r} is invalid: expected {expected}") from None


def _number(raw: str, kind: type, bound: str, example: str):
    """`raw` as `kind`, finite and within `bound`; ValueError "'RAW' is invalid: expected ..." otherwise."""
    within = _WITHIN[bound]
    hint = f", e.g. {example}" if example else ""
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is invalid: expected {'an integer' if kind is int else 'a number'}{hint}") from None
    if not (math.isfinite(value) and within(value)):
        expected = ("an integer" if kind is int else "a finite number") + (f" {bound}" if bound else "")
        raise ValueError(f"{raw!r} is invalid: expected {expected}{hint}")
    return value


def number_flag(flag: str, raw: str, kind: type, *, bound: str = "", example: str = ""):
    """`raw` as int or float, finite and within `bound` ("", "> 0" or ">= 0"); ValueError naming the flag,
    the text given and what it expects ("--stages '0' is invalid: expected an integer > 0")."""
    try:
        return _number(raw, kind, bound, example)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


def number_type(kind: type, *, bound: str = "", example: str = ""):
    """argparse `type=` doing `number_flag`'s check; argparse names the flag (`argument --blocks: '0'
    is invalid: expected an integer > 0`)."""
    def parse(text: str):
        try:
            return _number(text, kind, bound, example)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def layer_counts(text: str | None, flag: str = "--layer-counts") -> tuple[int, ...] | None:
    """`--layer-counts 3,3,2,2` as (3, 3, 2, 2), None when the flag is not given. Only the form is
    checked here; the split's owner (partition, PipelineConfig) says which counts fit the model."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r} is invalid: expected comma-separated positive integers, "
                         "e.g. 3,3,2,2") from None


# A number-table row: (flag, dest, type, default, help). Every flag is read as text (metavar N) and
# converted by `parse_number_flags`, so a bad value is the command's one `error:` line.
NumberFlag = tuple[str, str, type, object, str]


def add_number_flags(parser: argparse.ArgumentParser, table: tuple[NumberFlag, ...], required: tuple[str, ...]) -> None:
    """One text flag per row; `required` names those whose default is not used."""
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
        bound = "> 0" if flag in positive else ">= 0" if flag in non_negative else ""
        values[dest] = number_flag(flag, raw, kind, bound=bound)
    return values
