"""Rewrites tests/heavy_tests.txt, the in-process tests that `make test-fast` leaves out (marker `heavy`),
from a per-test CPU report of tests/cpu_report.py.

    bash scripts/run_tests.sh -q -n 2 -p tests.cpu_report --cpu-report /tmp/cpu.jsonl \\
        -m "not multihost and not ray and not distributed and not subprocess and not matrix"
    python3 scripts/heavy_tests.py /tmp/cpu.jsonl [--threshold 0.3]

The fast tier is what Makefile's FAST_MARKERS selects apart from `heavy` (read from the Makefile, so
the two cannot disagree). A test of that tier costing `--threshold` CPU-s or more is listed, except
each module's cheapest test: every module's area stays exercised by the inner loop. A report of the
whole suite (`make test`'s selection) serves as well; one without the tests listed now (a run of
`make test-fast` itself) is refused, since it would drop them all from the list.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAVY = "heavy"
HEADER = """\
# The in-process tests that `make test-fast` leaves out (marker `heavy`; `make test` runs them): each
# cost {threshold} CPU-s or more in a per-test CPU report (tests/cpu_report.py), less each module's
# cheapest test, which stays in the fast tier. One pytest node id a line. Written by
# scripts/heavy_tests.py; regenerate it rather than edit it (docs/testing.md says how).
"""


class Refusal(Exception):
    """Bad input: main prints it as one `error:` line, exits 2 and writes nothing."""


def fast_tier_exclusions(makefile: Path) -> set[str]:
    """The markers FAST_MARKERS deselects (`not a and not b ...`), less `heavy` itself."""
    match = re.search(r"^FAST_MARKERS\s*:?=\s*(.+)$", makefile.read_text(), re.MULTILINE)
    if match is None:
        raise Refusal(f"{makefile} has no FAST_MARKERS line; give the Makefile with --makefile")
    names = []
    for term in match.group(1).strip().split(" and "):
        word = re.fullmatch(r"not (\w+)", term.strip())
        if word is None:
            raise Refusal(f"{makefile}'s FAST_MARKERS term {term.strip()!r} is not `not NAME`; "
                          f"this script reads only a conjunction of `not NAME` terms")
        names.append(word.group(1))
    return set(names) - {HEAVY}


def read_report(report: Path) -> dict[str, dict]:
    """The report's records by test id (a test measured twice: its last record)."""
    if not report.is_file():
        raise Refusal(f"no report at {report}; write one with `-p tests.cpu_report --cpu-report FILE`")
    records: dict[str, dict] = {}
    for number, line in enumerate(report.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as bad:
            raise Refusal(f"{report} line {number} is not JSON ({bad.msg}); "
                          f"give a tests/cpu_report.py report") from None
        if not (isinstance(record, dict) and isinstance(record.get("id"), str)
                and isinstance(record.get("cpu"), (int, float)) and isinstance(record.get("markers"), list)):
            raise Refusal(f"{report} line {number} lacks id, cpu or markers; give a tests/cpu_report.py report")
        records[record["id"]] = record
    if not records:
        raise Refusal(f"{report} holds no test; run the tests with `--cpu-report {report}`")
    return records


def fast_tier(records: dict[str, dict], excluded: set[str]) -> list[dict]:
    """The records of tests `make test-fast` would run were none heavy."""
    return [r for r in records.values() if not (set(r["markers"]) - {HEAVY}) & excluded]


def choose_heavy(tier: list[dict], threshold: float) -> list[str]:
    """The tier's tests of `threshold` CPU-s or more, less each module's cheapest (the first if tied)."""
    cheapest: dict[str, dict] = {}
    for record in tier:
        module = record["id"].split("::", 1)[0]
        if module not in cheapest or record["cpu"] < cheapest[module]["cpu"]:
            cheapest[module] = record
    keep = {id(record) for record in cheapest.values()}
    return sorted(r["id"] for r in tier if r["cpu"] >= threshold and id(r) not in keep)


def listed_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    lines = (line.rstrip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a JSON-lines report of tests/cpu_report.py")
    parser.add_argument("--threshold", type=float, default=0.3, help="CPU-s from which a test is heavy (0.3)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "heavy_tests.txt")
    parser.add_argument("--makefile", type=Path, default=REPO / "Makefile")
    args = parser.parse_args(argv)
    try:
        if not args.threshold > 0:
            raise Refusal(f"--threshold {args.threshold} must be a positive number of CPU-seconds")
        excluded = fast_tier_exclusions(args.makefile)
        records = read_report(args.report)
        missing = [nodeid for nodeid in listed_ids(args.out) if nodeid not in records]
        if missing:
            raise Refusal(f"{args.report} has no figure for {len(missing)} test(s) of {args.out} (first: "
                          f"{missing[0]}); measure without `not heavy` (docs/testing.md), or delete a renamed "
                          f"test's line")
    except Refusal as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    tier = fast_tier(records, excluded)
    heavy = choose_heavy(tier, args.threshold)
    args.out.write_text(HEADER.format(threshold=args.threshold) + "".join(f"{n}\n" for n in heavy), encoding="utf-8")
    heavy_cpu = sum(records[n]["cpu"] for n in heavy)
    print(f"{args.out}: {len(heavy)} heavy tests ({heavy_cpu:.1f} CPU-s); the fast tier keeps "
          f"{len(tier) - len(heavy)} tests ({sum(r['cpu'] for r in tier) - heavy_cpu:.1f} CPU-s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
