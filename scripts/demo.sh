#!/usr/bin/env bash
# The main job: set up, then run the demo (plain Lightning and exact accumulation on the same data, curves on tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[demo] starting (loading torch and Lightning takes a few seconds); --help lists the options"
exec .venv/bin/python examples/demo.py "$@"
