#!/usr/bin/env bash
# Create a venv (once) and install the package into it, pinned by requirements/ci.txt: by default .venv with the
# contributor's test tools (extra [dev]); `VENV=.venv-demo EXTRAS=demo` the demo's own, smaller one (scripts/demo.sh).
# Says what it does; does nothing (and says so in one line) when the venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-dev}"
step() { printf '[setup] %s\n' "$*"; }
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON"))"
  "$PYTHON" -m venv "$VENV"
fi
stamp=$VENV/.lightning-accum-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/ci.txt -nt "$stamp" ]; then
  start=$SECONDS
  step "upgrading pip"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  step "installing torch 2.13.0 (CPU build; the largest download, a minute or two)"
  "$VENV/bin/python" -m pip install --quiet -c requirements/ci.txt torch==2.13.0
  case "$EXTRAS" in
    dev) what="lightning, tensorboard, matplotlib and the test tools" ;;
    demo) what="lightning, tensorboard and matplotlib" ;;
    *) what="lightning, tensorboard and the extra [$EXTRAS]" ;;
  esac
  step "installing lightning-accum (editable) with $what into $VENV"
  "$VENV/bin/python" -m pip install --quiet -c requirements/ci.txt -e ".[$EXTRAS]"
  touch "$stamp"
  step "done in $((SECONDS - start)) s"
else
  step "$VENV is up to date"
fi
