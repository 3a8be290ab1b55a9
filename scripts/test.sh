#!/usr/bin/env bash
# The test command: set up, then formatting, lint, types, and the whole test suite (doctests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0
.venv/bin/ruff format --check lightning_accum tests examples benchmarks
.venv/bin/ruff check lightning_accum tests examples benchmarks
.venv/bin/mypy
.venv/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
.venv/bin/python -m pytest "$@"
# The lowest Lightning the package declares, with the same torch: a declared subset (see the script).
if [ "$#" -eq 0 ]; then
  bash scripts/test-lowest.sh
fi
