#!/usr/bin/env bash
# The benchmark command: set up, then run every trial and write benchmarks/RESULTS.md (about 25 minutes on 2 quiet cores
# with `--reps 4 --updates 12 --paired-updates 150`, the settings of the committed results).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python benchmarks/run.py "$@"
