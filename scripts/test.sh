#!/usr/bin/env bash
# The test command: set up, then formatting, lint, types, and the whole test suite (doctests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0
.venv/bin/ruff format --check lightning_accum tests examples benchmarks scripts
.venv/bin/ruff check lightning_accum tests examples benchmarks scripts
# Types and the docs build side by side, one core each (mypy 48 s, Sphinx 17 s on a fresh clone): mypy's report is
# shown when it ends, and either failing fails the command.
mkdir -p build
.venv/bin/mypy >build/mypy.log 2>&1 &
mypy=$!
docs=0
.venv/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html || docs=$?
types=0
wait "$mypy" || types=$?
cat build/mypy.log
if [ "$docs" -ne 0 ] || [ "$types" -ne 0 ]; then
  exit 1
fi
.venv/bin/python -m pytest "$@"
# With no arguments (CI): then the package as a user installs it: the wheel alone in a fresh venv, and each extra (see
# the script). The lowest Lightning the package declares (2.6.6) is the pinned one, so the suite above tests it.
# Then the declared torch range: the named subset on the torch floor and the newest torch (see the script).
if [ "$#" -eq 0 ]; then
  bash scripts/check-package.sh
  bash scripts/check-torch-range.sh
fi
