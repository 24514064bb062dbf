"""Writes requirements/dev.lock, the exact versions `make install` puts beside torch.

    python3 scripts/lock_dev.py "torch==2.13.0" "triton>=3.0; platform_system == 'Linux'"   # `make lock`

`make install` runs two pips at once: one resolves torch (TORCH_SPEC) and Triton with their
dependencies, the other installs this lock with `--no-deps`, a list needing no resolution; the
package goes in last, `--no-deps`, and `pip check` then holds the whole environment to every
package's requirements. Two pips unpack the ~2.5 GB of wheels on both cores, where one pip unpacks
them on one (docs/testing.md#timings has the figures). The lock is what pip resolves for
`TORCH_SPEC .[dev]` on this machine's index, less what the first pip installs (torch, Triton and
their dependencies), so the two never write the same package. Run it again whenever pyproject.toml's
dependencies change: tests/repo/test_dev_lock.py fails until the lock meets them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "dev.lock"
HEADER = """\
# What `make install` installs with --no-deps beside torch and Triton (which a second pip resolves
# at the same time): pip's resolution of `{torch} .[dev]` for CPython {python} on {platform}, less
# torch's and Triton's own dependencies. Written by `make lock` (scripts/lock_dev.py); run it again
# whenever pyproject.toml's dependencies change (tests/repo/test_dev_lock.py says when).
"""


def resolve(requirements: list[str]) -> dict[str, str]:
    """{name: version} of what pip would install for `requirements` into an empty environment."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), *requirements], cwd=REPO, check=True, timeout=600)
        installs = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}


def main(argv: list[str]) -> int:
    """argv: what the first pip of `make install` resolves (TORCH_SPEC, TRITON_SPEC)."""
    if not argv:
        print('usage: lock_dev.py TORCH_SPEC [TRITON_SPEC]   (`make lock` passes the Makefile\'s)', file=sys.stderr)
        return 2
    torch_spec = argv[0]
    everything = resolve([torch_spec, ".[dev]"])
    first = resolve(argv)
    # The two resolutions agree on what they share: the lock's packages then meet torch's choices.
    differ = {name: (first[name], everything[name]) for name in first
              if name in everything and first[name] != everything[name]}
    if differ:
        print(f"error: torch and Triton alone resolve other versions than with .[dev]: {differ}; pin them "
              "in pyproject.toml", file=sys.stderr)
        return 1
    locked = sorted((name, version) for name, version in everything.items()
                    if name not in first and name != "attnres-pp")
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(HEADER.format(torch=torch_spec, python=".".join(map(str, sys.version_info[:2])),
                                  platform=sys.platform)
                    + "".join(f"{name}=={version}\n" for name, version in locked))
    print(f"{LOCK.relative_to(REPO)}: {len(locked)} packages ({len(first)} come with {torch_spec} and Triton)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
