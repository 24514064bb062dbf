#!/usr/bin/env bash
# Runs the test suite and makes pytest's "no tests collected" (exit 5) an explicit failure:
# a suite that runs nothing must never pass by accident.
set -uo pipefail
cd "$(dirname "$0")/.."
# The suite starts hundreds of interpreters (rank processes, Ray workers, CLI runs); where the
# environment forbids writing bytecode, each one compiles the package's modules again, and every
# pytest process rewrites every test module's asserts again (collection: 10.4 CPU-s, 6.1 with the
# cache). The clone's __pycache__ folders are ignored by git.
unset PYTHONDONTWRITEBYTECODE
python3 -m pytest -p no:benchmark "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests (exit 5); the suite must run tests" >&2
  exit 1
fi
exit "$status"
