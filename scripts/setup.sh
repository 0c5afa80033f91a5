#!/usr/bin/env bash
# Creates .venv and installs moe_plugin with its tested pins. torch goes first, from the CPU wheel, and is
# then held by a constraint so no dependency can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
constraints=$(mktemp)
echo "torch==2.13.0" > "$constraints"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -c "$constraints" -e ".[test]"
rm -f "$constraints"
