"""The repository stands alone (docs/architecture.md rule 15): no tracked text file points at a path
outside the checkout, and every numbered reference into the project's own references names
something that exists.

Scanned: every file `git ls-files` lists that is text (no NUL byte, valid UTF-8). Refused:

- paths into a shared folder beside the checkout (dot-dot-slash `shared`, `shared/` + the old
  spec or design file names);
- the old upper-case file names and their short forms (the spec's name in capitals with `.md`,
  "section" or a section number after it; the design file's, with `.md` or "rule"): the references
  are `docs/spec.md section N` and `docs/architecture.md rule N`;
- absolute paths into /work, /root or /home (a results file records paths relative to the
  repository root).

Checked: each `spec.md section N` (also `sections 1.1-1.4 and 2`) names a heading of docs/spec.md,
and each `architecture.md rule N` a numbered rule of docs/architecture.md. The forbidden patterns
are assembled from pieces so that this file passes its own scan.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.run_helpers import REPO

SPEC_FILE = REPO / "docs" / "spec.md"
ARCHITECTURE_FILE = REPO / "docs" / "architecture.md"

_SPEC, _DESIGN = "SP" + "EC", "DE" + "SIGN"  # the old names, upper case
_SPEC_MD, _ARCH_MD, _ABS = "docs/spec" + ".md", "docs/architecture" + ".md", "/" + "work/"  # for planted lines
FORBIDDEN: list[tuple[str, re.Pattern[str]]] = [
    ("a path into a shared folder outside the repository", re.compile(r"\.\./shared\b")),
    ("a path into a shared folder outside the repository", re.compile(rf"\bshared/(?:{_SPEC}|{_DESIGN})")),
    (f"{_SPEC}.md: the reference is docs/spec.md", re.compile(rf"\b{_SPEC}\.md\b")),
    (f"{_SPEC} section N: the reference is docs/spec.md section N",
     re.compile(rf"\b{_SPEC}(?:'s)?\s+(?:sections?\s+)?\d")),
    (f"{_DESIGN}.md: the reference is docs/architecture.md", re.compile(rf"\b{_DESIGN}\.md\b")),
    (f"{_DESIGN} rule N: the reference is docs/architecture.md rule N", re.compile(rf"\b{_DESIGN}\s+rules?\b")),
    ("an absolute path into this machine: make it relative to the repository root",
     re.compile(r"(?<![\w.~-])/(?:work|root|home)/")),
]

NUM = r"\d+(?:\.\d+)?"
# "spec.md section 4.1", "[spec.md](spec.md) section 5", "spec.md sections 1.1-1.4 and 2",
# "spec.md section 6, section 1.4"; the words may be split over a line break.
SPEC_REF = re.compile(
    rf"spec\.md\)?\s+sections?\s+({NUM}(?:(?:\s*(?:-|,|and|to)\s*(?:section\s+)?){NUM})*)")
RULE_REF = re.compile(r"architecture(?:\.md)?\)?\s+rules?\s+(\d+(?:(?:\s*(?:-|,|and|to)\s*)\d+)*)")
HEADING = re.compile(rf"^#{{2,}}\s+({NUM})\.?\s", re.MULTILINE)


def scan_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, reason, line) for every forbidden reference in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [(number, reason, line.strip()) for reason, pattern in FORBIDDEN if pattern.search(line)]
    return found


def spec_sections(text: str) -> set[str]:
    """The section numbers of docs/spec.md's headings: "1", "1.1", ..., "10"."""
    return set(HEADING.findall(text))


def architecture_rules(text: str) -> set[str]:
    """The numbers of the rules listed under docs/architecture.md's "Rules of the house"."""
    section = text.split("## Rules of the house", 1)[-1].split("\n## ", 1)[0]
    return set(re.findall(r"^(\d+)\.\s", section, re.MULTILINE))


def _numbers(listed: str) -> list[str]:
    return re.findall(NUM, listed)


def dangling_refs(text: str, sections: set[str], rules: set[str]) -> list[tuple[int, str]]:
    """(line number, reference) for every section or rule reference that names nothing."""
    bad = []
    for pattern, known in ((SPEC_REF, sections), (RULE_REF, rules)):
        for match in pattern.finditer(text):
            if any(n not in known for n in _numbers(match.group(1))):
                bad.append((text.count("\n", 0, match.start()) + 1, " ".join(match.group(0).split())))
    return bad


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True,
                                capture_output=True, timeout=60).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout, so there is no list of tracked files: {error}")
    files = []
    for name in filter(None, listed.split("\0")):
        path = REPO / name
        if not path.is_file():
            continue  # deleted in the work tree, not yet in the index
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


# ---- the scanner itself: it must be able to fail ---------------------------------------------

def test_the_scanner_finds_planted_references():
    planted = "\n".join([
        "ok line",
        "see ../" + f"shared/{_SPEC}.md for the math",
        f"the cached rule ({_SPEC} section 4)",
        f"    # {_SPEC} 8's optimizer_bytes",
        f"Dispatch on action kind ({_DESIGN} rule 3).",
        f"the layering of {_DESIGN}.md",
        f"written to {_ABS}main/benchmarks/results/x.json",
        "run_dir: " + "/home" + "/someone/runs/a",
    ])
    lines = sorted({number for number, _, _ in scan_text(planted)})
    assert lines == [2, 3, 4, 5, 6, 7, 8], scan_text(planted)


def test_the_scanner_passes_what_is_allowed():
    allowed = "\n".join([
        "TORCH_SPEC ?= torch==2.13.0",
        "_SPECIAL_ADDRESSES = ('auto', 'local')",
        f"the cached rule ({_SPEC_MD} section 4); {_ARCH_MD} rule 3",
        "traces under benchmarks/results/bubbles/trace.json, runs under runs/quality",
        "--out /shared/runs/multinode on a cluster's shared disk",
        "the specification (spec.md) and its design",
    ])
    assert scan_text(allowed) == []


def test_dangling_section_and_rule_references_are_found():
    sections, rules = {"1", "1.1", "1.4", "2", "4", "4.1"}, {"1", "2", "3"}
    text = "\n".join([
        f"{_SPEC_MD} section 4.1 and [spec.md](spec.md) section 2",
        f"{_SPEC_MD} sections 1.1-1.4 and 2; {_SPEC_MD} section 1, section 4",
        f"{_ARCH_MD} rule 3, architecture rule 2",
        f"{_SPEC_MD} section 11",
        f"{_SPEC_MD} sections 1.1-1.5",
        f"{_SPEC_MD}\nsection 4.3",  # lines 6 and 7
        f"{_ARCH_MD} rule 16",
    ])
    assert [number for number, _ in dangling_refs(text, sections, rules)] == [4, 5, 6, 8]


# ---- the repository ----------------------------------------------------------------------------

def test_spec_keeps_its_section_numbers():
    sections = spec_sections(SPEC_FILE.read_text())
    expected = {str(n) for n in range(1, 11)} | {"1.1", "1.2", "1.3", "1.4", "4.1", "4.2"}
    assert expected <= sections, f"docs/spec.md lacks sections {sorted(expected - sections)}"


def test_architecture_keeps_its_rule_numbers():
    rules = architecture_rules(ARCHITECTURE_FILE.read_text())
    assert rules == {str(n) for n in range(1, 18)}, sorted(rules, key=int)


@pytest.mark.subprocess  # `git ls-files` names the tracked files
def test_no_tracked_file_points_outside_the_repository():
    files = tracked_text_files()
    assert len(files) > 50, "the scan found almost no files: is this the repository?"
    offenders = [f"{path.relative_to(REPO)}:{number}: {reason}: {line[:160]}"
                 for path in files for number, reason, line in scan_text(path.read_text(encoding="utf-8"))]
    assert not offenders, "references that leave the repository:\n" + "\n".join(offenders)


@pytest.mark.subprocess  # `git ls-files` names the tracked files
def test_every_section_and_rule_reference_exists():
    sections = spec_sections(SPEC_FILE.read_text())
    rules = architecture_rules(ARCHITECTURE_FILE.read_text())
    offenders = [f"{path.relative_to(REPO)}:{number}: {ref}"
                 for path in tracked_text_files()
                 for number, ref in dangling_refs(path.read_text(encoding="utf-8"), sections, rules)]
    assert not offenders, "references to sections or rules that do not exist:\n" + "\n".join(offenders)
