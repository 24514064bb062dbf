"""requirements/dev.lock, what `make install` installs with --no-deps beside torch and Triton, meets
pyproject.toml: every requirement of the package and of its `dev` extra that the other pip does not
install is pinned there at a version its specifier allows, once. A dependency added to pyproject.toml
without `make lock` fails here, naming what to run (`pip check` at the end of `make install` would
catch it too, but only after minutes of install)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "dev.lock"


def _first_pip() -> set[str]:
    """The names `make install`'s first pip resolves (TORCH_SPEC and TRITON_SPEC's)."""
    makefile = (REPO / "Makefile").read_text()
    specs = [re.search(rf"^{name}\s*[?:]?=\s*(.+)$", makefile, re.M)[1] for name in ("TORCH_SPEC", "TRITON_SPEC")]
    return {canonicalize_name(Requirement(spec).name) for spec in specs}


def _locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and name.strip() == name and version.strip() == version, f"not `name==version`: {line!r}"
        key = canonicalize_name(name)
        assert key not in pins, f"{name} pinned twice"
        pins[key] = version
    return pins


def _required() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]


def test_the_first_pip_installs_torch_and_triton_and_the_lock_neither():
    first, pins = _first_pip(), _locked()
    assert first == {"torch", "triton"}
    assert not first & set(pins), "the two pips of `make install` would both write these"


def test_every_requirement_is_pinned_at_a_version_it_allows():
    first, pins = _first_pip(), _locked()
    unmet = []
    for requirement in _required():
        name = canonicalize_name(requirement.name)
        if name in first or (requirement.marker is not None and not requirement.marker.evaluate()):
            continue
        if name not in pins or not requirement.specifier.contains(pins[name], prereleases=True):
            unmet.append(f"{requirement} (locked: {pins.get(name, 'none')})")
    assert not unmet, f"requirements/dev.lock does not meet pyproject.toml: {unmet}; run `make lock`"
