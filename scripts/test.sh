#!/usr/bin/env bash
# Sets up the environment, lints and checks the formatting (ruff, configured in pyproject.toml) and runs the whole
# test suite (what .ci/run calls). A lint finding or an unformatted file fails the command before any test runs
# (`.venv/bin/ruff format .` formats the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q --durations=40 tests "$@"
