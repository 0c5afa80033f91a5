#!/usr/bin/env bash
# Sets up the environment, lints (ruff, configured in pyproject.toml) and runs the whole test suite (what .ci/run
# calls). A lint finding fails the command before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q --durations=40 tests "$@"
