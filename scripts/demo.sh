#!/usr/bin/env bash
# The main job: set up, then run the end-to-end example training run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/train_tiny_lm.py "$@"
