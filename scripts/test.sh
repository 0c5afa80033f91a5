#!/usr/bin/env bash
# Sets up the environment, lints and checks the formatting (ruff, configured in pyproject.toml) and runs the test
# suite (what .ci/run calls). A lint finding or an unformatted file fails the command before any test runs
# (`.venv/bin/ruff format .` formats the tree).
#
#   bash scripts/test.sh          every test (the full tier, what CI runs)
#   bash scripts/test.sh --fast   every test that is neither `distributed` nor `slow` (docs/testing.md)
#
# Any other argument goes to pytest, e.g. `bash scripts/test.sh --fast tests/ops` or `-k name`.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
args=()
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then
        tier=(-m "not distributed and not slow")
    else
        args+=("$arg")
    fi
done
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
[ ${#args[@]} -gt 0 ] || args=(tests)
exec .venv/bin/python -m pytest -q --durations=15 "${tier[@]}" "${args[@]}"
