#!/usr/bin/env bash
# Build the documentation site strictly (warnings fail) into docs/_build/html.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
echo "docs built: docs/_build/html/index.html"
