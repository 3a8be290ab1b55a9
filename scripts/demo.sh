#!/usr/bin/env bash
# The main job: set up, then run the demo (several accumulation splits of one small GPT, curves on tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
