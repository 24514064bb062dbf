"""Every `attnres-pp ...` and `attnres-lab ...` command that README.md and docs/*.md show must parse:
its subcommand path exists (`attnres-pp simulate comm`, `attnres-pp bench bubbles`) and every `--flag`
it uses is a flag of that subcommand, spelled in full (argparse would accept an abbreviation; a reader copying it should
not depend on that), with a value from the flag's choices where it has choices.

Commands are taken from code blocks (fenced or indented) and from inline code spans. In a code
block a line ending in `\\` continues on the next one, a leading `$ ` prompt is dropped, and `# ...`
is a comment. What the docs write as a pattern rather than a literal command is read as such:
`a|b|c` stands for each of its alternatives, `[--flag VALUE]` for an optional flag, and `...` for
"more flags" (skipped). Values are checked only against a flag's choices: a placeholder such as
`FILE`, `RUN_DIR` or `<date>` stands for a value the reader supplies, and the value types are the
CLI's own business (`tests/unit/test_bad_inputs.py`).

The parser is built in this process from `attnres_pp.cli.build_parser`, which imports every
subcommand's CLI module but not Ray (checked below in a fresh interpreter); an `attnres-lab` command
is checked against the lab's own parser (`attnres_lab.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_lab.cli import build_parser as build_lab_parser
from attnres_pp.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAM = "attnres-pp"
LAB_PROGRAM = "attnres-lab"
# `attnres-pp` (or `attnres-lab`) as a word (not inside a path such as /abs/path/attnres-pp/configs)
# followed by a subcommand.
COMMAND_START = re.compile(r"(?:^|(?<=[\s(]))(attnres-pp|attnres-lab)\s+(?=[a-z])")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")
ERROR_LINE = re.compile(r"(^|\s)error:")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+\.)\s")


def _commands_in_code(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, command) for each command in one code block, continuations joined."""
    found, pending, start = [], "", 0
    for number, raw in lines:
        text = raw.strip()
        if not pending:
            start = number
            if text.startswith("$ "):
                text = text[2:]
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        found.extend((start, command) for command in _commands_in_text(pending + text))
        pending = ""
    if pending:
        found.extend((start, command) for command in _commands_in_text(pending))
    return found


def _commands_in_text(text: str) -> list[str]:
    """The `attnres-pp SUB ...` commands in one line of shell (`ray job submit ... -- attnres-pp train`)."""
    if ERROR_LINE.search(text):
        return []  # a quoted error message (`error: ...`, `attnres-pp bench X: error: ...`) is output
    match = COMMAND_START.search(text)  # the rest of the line is that command's (`;` does not occur)
    return [match.group(1) + " " + text[match.end():]] if match else []


def extract_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command line) for every `attnres-pp` command in one Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[tuple[int, str]] = []
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    in_fence = False
    previous_blank = True

    def flush_prose() -> None:
        # Inline code may wrap over lines within a paragraph: find spans in the joined paragraph.
        if not prose:
            return
        joined = " ".join(text for _, text in prose)
        offsets = []  # character offset where each prose line starts in `joined`
        position = 0
        for number, text in prose:
            offsets.append((position, number))
            position += len(text) + 1
        for match in INLINE_CODE.finditer(joined):
            number = max(n for offset, n in offsets if offset <= match.start())
            found.extend((number, command) for command in _commands_in_text(match.group(1)))
        prose.clear()

    for number, line in enumerate(lines, start=1):
        if FENCE.match(line):  # opens or closes a fenced block: what came before it is complete
            found.extend(_commands_in_code(code))
            code.clear()
            flush_prose()
            in_fence = not in_fence
            previous_blank = True
            continue
        if in_fence:
            code.append((number, line))
            continue
        # An indented code block starts after a blank line (a list item's continuation does not).
        starts_block = previous_blank and not LIST_ITEM.match(line)
        if line.startswith("    ") and line.strip() and (code or starts_block):
            flush_prose()
            code.append((number, line))
        else:
            if code:
                found.extend(_commands_in_code(code))
                code.clear()
            if line.strip():
                prose.append((number, line))
            else:
                flush_prose()
        previous_blank = not line.strip()
    if code:
        found.extend(_commands_in_code(code))
    flush_prose()
    return found


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _alternatives(token: str) -> list[str]:
    return [part for part in token.split("|") if part]


def check_command(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """What is wrong with `command` against `parser`: an empty list when it parses at --help level."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as error:
        return [f"cannot split the command line: {error}"]
    if not tokens or tokens[0] != parser.prog:
        return [f"does not start with {parser.prog}"]
    tokens = [token.strip("[]") for token in tokens[1:]]
    tokens = [token for token in tokens if token and token not in ("...", "..")]
    problems: list[str] = []
    path = parser.prog
    # Walk the subcommands: `attnres-pp simulate comm ...`.
    while (sub := _subparsers(parser)) is not None:
        if not tokens:
            return problems  # the name of a command group, e.g. "`attnres-pp simulate` needs no GPU"
        if tokens[0].startswith("-"):
            return problems + [f"`{path}` needs a subcommand: one of {', '.join(sub.choices)}"]
        name = tokens.pop(0)
        unknown = [alt for alt in _alternatives(name) if alt not in sub.choices]
        if unknown:
            return problems + [f"`{path}` has no subcommand {', '.join(unknown)} (it has {', '.join(sub.choices)})"]
        path = f"{path} {_alternatives(name)[0]}"
        parser = sub.choices[_alternatives(name)[0]]
    positionals = [a for a in parser._actions if not a.option_strings]
    options = parser._option_string_actions
    while tokens:
        token = tokens.pop(0)
        if token.startswith("-") and token != "-":
            flag, has_value, value = token.partition("=")
            action = options.get(flag)
            if action is None:
                problems.append(f"`{path}` has no flag {flag}")
                continue
            if action.nargs == 0:
                if has_value:
                    problems.append(f"`{path} {flag}` takes no value")
                continue
            if not has_value:
                if not tokens or (tokens[0].startswith("-") and tokens[0] != "-"):
                    problems.append(f"`{path} {flag}` needs a value")
                    continue
                value = tokens.pop(0)
            problems.extend(_check_choices(path, flag, action, value))
        elif positionals:
            # A positional with nargs "+" or "*" (`attnres-pp plot RUN ...`) takes every later argument.
            action = positionals[0] if positionals[0].nargs in ("+", "*") else positionals.pop(0)
            problems.extend(_check_choices(path, action.dest, action, token))
        else:
            problems.append(f"`{path}` takes no argument {token!r}")
    return problems


def _check_choices(path: str, name: str, action: argparse.Action, value: str) -> list[str]:
    if action.choices is None or "<" in value:
        return []
    wrong = [alt for alt in _alternatives(value) if alt not in action.choices]
    if wrong:
        return [f"`{path} {name}` does not accept {', '.join(wrong)} (choices: {', '.join(map(str, action.choices))})"]
    return []


def _documented() -> list[tuple[str, int, str]]:
    commands = []
    for path in DOC_FILES:
        for number, command in extract_commands(path):
            commands.append((path.relative_to(REPO).as_posix(), number, command))
    return commands


DOCUMENTED = _documented()


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def lab_parser() -> argparse.ArgumentParser:
    return build_lab_parser()


def test_docs_show_commands():
    # The extraction must find the docs' commands; were it broken, every case below would vanish.
    assert len(DOCUMENTED) >= 40, [f"{path}:{number}" for path, number, _ in DOCUMENTED]
    files = {path for path, _, _ in DOCUMENTED}
    assert "README.md" in files and len(files) >= 5, files


@pytest.mark.parametrize(
    "where, command",
    [(f"{path}:{number}", command) for path, number, command in DOCUMENTED],
    ids=[f"{path}:{number}:{command[:70]}" for path, number, command in DOCUMENTED],
)
def test_documented_command_parses(parser, lab_parser, where, command):
    problems = check_command(lab_parser if command.startswith(LAB_PROGRAM + " ") else parser, command)
    assert not problems, f"{where}: {command}\n" + "\n".join(problems)


@pytest.mark.parametrize("command", [
    "attnres-pp train --no-such-flag",
    "attnres-pp train --launcher local --no-such-flag 3",
    "attnres-pp train --stage 2",  # an abbreviation of --stages: argparse takes it, the docs must not
    "attnres-pp no-such-command --steps 1",
    "attnres-pp simulate no-such-command",
    "attnres-pp simulate comm --no-such-flag",
    "attnres-pp simulate schedule --schedule no_such_schedule",
    "attnres-pp bench no-such-benchmark",
    "attnres-pp bench bubbles|no-such-benchmark --quick",
    "attnres-pp bench bubbles --quick=yes",
    "attnres-pp generate --resume runs/a --prompt",
    "attnres-pp simulate --layers 4",
])
def test_checker_rejects_mistakes(parser, command):
    assert check_command(parser, command), command


@pytest.mark.parametrize("command", [
    "attnres-pp train --launcher local --stages 2 --virtual 2 ...  # a comment --no-such-flag",
    "attnres-pp bench bubbles|comm --quick --json",
    "attnres-pp simulate schedule --schedule zb_h1 [--json]",
    "attnres-pp simulate predict --calibration benchmarks/results/fidelity_<date>.json",
    "attnres-pp simulate ...   # the group",
])
def test_checker_accepts_patterns(parser, command):
    assert check_command(parser, command) == [], command


def test_lab_commands_are_found_and_checked_against_the_labs_parser(lab_parser, parser):
    """The docs name the lab's commands, and the checker holds them to the lab's parser: a real one
    parses there and not as an `attnres-pp` command; a mistake is reported."""
    assert any(command.startswith(LAB_PROGRAM + " ") for _, _, command in DOCUMENTED)
    assert check_command(lab_parser, "attnres-lab fidelity --hosts --quick") == []
    assert check_command(lab_parser, "attnres-lab fit-memory-units --out FILE") == []
    assert check_command(lab_parser, "attnres-lab fidelity --no-such-flag")
    assert check_command(lab_parser, "attnres-lab no-such-study")
    assert check_command(parser, "attnres-lab fidelity")  # not a command of attnres-pp
    assert check_command(parser, "attnres-pp bench fidelity")  # a study of the lab, not a benchmark


def test_extraction_reads_blocks_continuations_and_inline_code(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `attnres-pp bench split` or\n"
        "`attnres-pp simulate schedule --stages 64\n"
        "--virtual 8` (wrapped).\n"
        "\n"
        "```sh\n"
        "$ attnres-pp simulate comm --layers 16 \\\n"
        "      --block-size 4\n"
        "output line\n"
        "ray job submit -- attnres-pp train --steps 1\n"
        "```\n"
        "\n"
        "    attnres-pp generate --resume runs/a   # indented block\n"
        "    ray job submit -- attnres-pp train \\\n"
        "        --config c.toml\n"
        "\n"
        "Not a command: /abs/path/attnres-pp/configs, `attnres-pp` alone, `attnres-pp bench X: error: ...`.\n",
        encoding="utf-8")
    assert extract_commands(doc) == [
        (1, "attnres-pp bench split"),
        (2, "attnres-pp simulate schedule --stages 64 --virtual 8"),
        (6, "attnres-pp simulate comm --layers 16  --block-size 4"),
        (9, "attnres-pp train --steps 1"),
        (12, "attnres-pp generate --resume runs/a   # indented block"),
        (13, "attnres-pp train  --config c.toml"),
    ]


@pytest.mark.subprocess
def test_building_the_parser_does_not_import_ray():
    code = ("import sys; from attnres_pp.cli import build_parser; build_parser(); "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or "building the parser imported ray"
