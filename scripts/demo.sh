#!/usr/bin/env bash
# The main job: set up the demo's own venv (.venv-demo: torch CPU, Lightning, TensorBoard, matplotlib; not the test
# tools of .venv), then run the demo (plain Lightning and exact accumulation on the same data, curves on tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-demo EXTRAS=demo bash scripts/setup.sh
echo "[demo] starting (loading torch and Lightning takes a few seconds); --help lists the options"
exec .venv-demo/bin/python examples/demo.py "$@"
