#!/usr/bin/env bash
# Create .venv (once) and install the package with its test tools, pinned by requirements/ci.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.lightning-accum-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/ci.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt torch==2.13.0
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt -e ".[dev]"
  touch "$stamp"
fi
