#!/usr/bin/env bash
# Create .venv (once) and install the package with its test tools, pinned by requirements/ci.txt.
# Says what it does; does nothing (and says so in one line) when .venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
step() { printf '[setup] %s\n' "$*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON"))"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.lightning-accum-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/ci.txt -nt "$stamp" ]; then
  start=$SECONDS
  step "upgrading pip"
  .venv/bin/python -m pip install --quiet --upgrade pip
  step "installing torch 2.13.0 (CPU build; the largest download, a minute or two)"
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt torch==2.13.0
  step "installing lightning-accum (editable) with lightning, tensorboard, matplotlib and the test tools"
  .venv/bin/python -m pip install --quiet -c requirements/ci.txt -e ".[dev]"
  touch "$stamp"
  step "done in $((SECONDS - start)) s"
else
  step ".venv is up to date"
fi
