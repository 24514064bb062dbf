#!/usr/bin/env bash
# Runs the test suite and makes pytest's "no tests collected" (exit 5) an explicit failure:
# a suite that runs nothing must never pass by accident.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -p no:benchmark "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests (exit 5); the suite must run tests" >&2
  exit 1
fi
exit "$status"
