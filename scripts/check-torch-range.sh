#!/usr/bin/env bash
# The declared torch range is the tested range: run by scripts/test.sh (with no arguments) after the packaging check;
# standalone too. The suite above runs on the pinned torch 2.13.0 (CPU build); this runs the named subset of
# scripts/torch_range_tests.py (every private torch / Lightning name of docs/internals.md, DDP, FSDP2, tensor
# parallelism, Fabric, GradScaler skips, checkpoints, evaluation) on the two ends of the range:
#  - the floor pyproject.toml declares (`torch>=X`: torch X.0);
#  - the newest torch the registry serves to this Python (`pip index versions torch`), or TORCH_NEWEST=<version>.
# Each in a fresh venv under build/torch-range (ignored by git): torch first, then the package (editable, with the
# [hf] and [rich] extras the subset uses) and the test tools, everything else pinned by requirements/ci.txt (Lightning
# 2.6.6 included) but torch. These are the registry's Linux wheels: CUDA builds (torch plus its nvidia-* and triton
# wheels, 3 to 5 GB installed) that run on the CPU when there is no GPU; nothing needs a GPU or a driver to install.
# PIP_CONSTRAINT is set to those pins for every pip command here, which also lifts a machine-wide torch cap a pip
# configuration may set. The newest torch's install runs while the floor's tests run. The venvs are removed when it
# passes. docs/reliability.md, "The torch range", has the times measured.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
WORK=build/torch-range
start=$SECONDS
step() { printf '[torch-range] %s (%d s)\n' "$*" "$((SECONDS - start))"; }

rm -rf "$WORK"
mkdir -p "$WORK"
grep -v '^torch==' requirements/ci.txt >"$WORK/constraints.txt"
export PIP_CONSTRAINT="$ROOT/$WORK/constraints.txt"
floor=$("$PYTHON" scripts/torch_range_tests.py --floor)
newest="${TORCH_NEWEST:-$("$PYTHON" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')}"
if [ -z "$newest" ]; then
  echo "[torch-range] pip found no torch in the registry (pip index versions torch); set TORCH_NEWEST=<version>" >&2
  exit 1
fi
mapfile -t tests < <("$PYTHON" scripts/torch_range_tests.py)
step "torch $floor (the floor pyproject.toml declares) and torch $newest (the newest the registry serves);" \
  "${#tests[@]} test files and guards"

# A venv with torch $1 and the package: its log in $WORK/install-$1.log, its time printed.
install() {
  local version=$1 venv="$ROOT/$WORK/torch-$1" began=$SECONDS
  {
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install "torch==$version"
    "$venv/bin/python" -m pip install -e ".[hf,rich]" pytest pytest-timeout hypothesis jsonargparse "torch==$version"
    "$venv/bin/python" -m pip check
  } >"$WORK/install-$version.log" 2>&1 || {
    cat "$WORK/install-$version.log"
    echo "[torch-range] installing torch $version failed: its log is above" >&2
    return 1
  }
  rm -rf lightning_accum.egg-info  # left in the tree by the editable install
  step "torch $version installed in $((SECONDS - began)) s ($(du -sh "$venv" | cut -f1))"
}

# The subset on torch $1, its version printed by the interpreter that runs it.
run_subset() {
  local venv="$ROOT/$WORK/torch-$1" began=$SECONDS
  step "the subset on torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): $("$venv/bin/python" \
    -c 'import lightning, sys; print(f"Lightning {lightning.__version__}, Python {sys.version.split()[0]}")')"
  PYTHONHASHSEED=0 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
  step "the subset passed on torch $1 in $((SECONDS - began)) s"
}

install "$floor"
install "$newest" &
newest_install=$!
trap 'kill "$newest_install" 2>/dev/null || true' EXIT  # a failed floor stops the other install too
run_subset "$floor"
rm -rf "$WORK/torch-$floor"
wait "$newest_install"
run_subset "$newest"
rm -rf "$WORK/torch-$newest"
step "done: the subset passes on torch $floor and torch $newest"
