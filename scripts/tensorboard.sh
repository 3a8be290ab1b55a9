#!/usr/bin/env bash
# Open TensorBoard on the demo's logs (or on the folder given as the first argument), from any folder.
# Usage: bash scripts/tensorboard.sh [LOGDIR] [other tensorboard options]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
logdir="$root/runs/demo"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  logdir="$(cd "$1" && pwd)"  # relative to where the command is typed
  shift
fi
VENV=.venv-demo EXTRAS=demo bash "$root/scripts/setup.sh"  # the demo's venv holds TensorBoard
echo "tensorboard --logdir $logdir (stop it with Ctrl+C)"
exec "$root/.venv-demo/bin/tensorboard" --logdir "$logdir" "$@"
