#!/usr/bin/env bash
# The benchmark command: set up, then run every trial and write benchmarks/RESULTS.md (about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python benchmarks/run.py "$@"
