#!/usr/bin/env bash
# The package as a user gets it, run by scripts/test.sh (with no arguments) after the test suite; standalone too.
#  1. build the sdist and, from it, the wheel (python -m build, in an isolated build environment);
#  2. check what they hold (scripts/package_contents.py): the wheel the package, py.typed and LICENSE and nothing else,
#     and a Lightning range from 2.6.6 on; the sdist what its tests read;
#  3. run the test files that read the tree (layout, docs' tables, the declared ranges) from the unpacked sdist;
#  4. install the wheel alone in a fresh venv (no editable install, no dev extras), torch 2.13.0 first as the README
#     says so that the CPU build is kept, and run scripts/package_smoke.py there: a Trainer fit with strategy="accum",
#     AxisLogger and AccumulationReport and a Fabric loop, each compared with a float64 reference;
#  5. every extra alone: a venv per extra, cloned by hard links from the one of step 4 (the wheel and torch installed
#     once, so each extra costs only its own packages), the extra installed into it, then what it is for is used
#     (scripts/package_smoke.py <extra>; `litgpt --help` for [litgpt]) and `pip check` says the set is consistent.
#  6. (unconstrained pass only) `[dev]` and the extras together resolved (`pip install --dry-run --report`), as a
#     contributor's `pip install -e ".[dev]"` and a user's `pip install "lightning-accum[demo,hf,litgpt,loggers,rich]"`
#     would, and the three patches in examples/litgpt/ `git apply --check`-ed against the litgpt each resolved.
# Steps 4 and 5 run twice, side by side: under requirements/ci.txt's pins (the versions CI knows to be good), and
# unconstrained but for torch==2.13.0 (`pip install "<wheel>[<extra>]" torch==2.13.0`: the newest releases the ranges
# admit, what a user who installs today gets). pip's cache is reused. It works in build/package-check (ignored by git),
# laid anew on each run; the venvs are removed when it passes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
WORK=build/package-check
CONSTRAINTS="$ROOT/requirements/ci.txt"
EXTRAS=(hf loggers rich litgpt demo)  # [docs] and [dev] are what scripts/setup.sh installs into .venv
start=$SECONDS
step() { printf '[package] %s (%d s)\n' "$*" "$((SECONDS - start))"; }
quiet() {  # run a command, showing its output only when it fails
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    cat "$log"
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

rm -rf "$WORK"
mkdir -p "$WORK"
step "a venv with the build tool"
"$PYTHON" -m venv "$WORK/tools"
quiet "$WORK/tools/bin/python" -m pip install -c "$CONSTRAINTS" build
step "building the sdist, then the wheel from the sdist"
quiet "$WORK/tools/bin/python" -m build --outdir "$WORK/dist" .
rm -rf lightning_accum.egg-info  # left in the tree by the sdist's build
wheel=$(echo "$ROOT/$WORK"/dist/*.whl)
sdist=$(echo "$ROOT/$WORK"/dist/*.tar.gz)
"$WORK/tools/bin/python" scripts/package_contents.py "$wheel" "$sdist"

if [ -x .venv/bin/python ]; then
  step "the tests that read the tree, run from the unpacked sdist"
  mkdir -p "$WORK/sdist"
  tar -xzf "$sdist" -C "$WORK/sdist"
  (cd "$WORK"/sdist/* && PYTHONPATH=$PWD "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/project/test_layout.py tests/project/test_packaging.py)
fi

# Step 6 for one set of extras ($2) in the venv $1 (torch 2.13.0 installed, so pip keeps it): resolve, no install;
# then the litgpt it resolved, unpacked, takes each patch (`git apply --check`: a patch that no longer fits fails here).
together() {
  local venv=$1 extras=$2 report litgpt unpacked patch
  report="$ROOT/$WORK/resolved-$extras.json"
  quiet "$venv/bin/python" -m pip install --dry-run --quiet --report "$report" "$wheel[$extras]" torch==2.13.0
  litgpt=$("$venv/bin/python" -I -c 'import json, sys
versions = {p["metadata"]["name"]: p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"]}
print(versions["litgpt"])' "$report")
  unpacked="$ROOT/$WORK/litgpt-$extras"
  mkdir -p "$unpacked"
  quiet "$venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$unpacked" "litgpt==$litgpt"
  "$venv/bin/python" -I -m zipfile -e "$unpacked"/litgpt-*.whl "$unpacked"
  for patch in "$ROOT"/examples/litgpt/*.patch; do
    if ! (cd "$unpacked" && git apply --check "$patch"); then
      echo "[package] [$extras] resolved litgpt $litgpt, which examples/litgpt/$(basename "$patch") does not apply to:" \
        "update the patches, or raise [litgpt]'s floor / cap it in pyproject.toml" >&2
      return 1
    fi
  done
  echo "[package] [$extras] resolves litgpt $litgpt; the three patches apply to it"
}

# One pass of steps 4 and 5: $1 names it (pinned, latest), the rest are pip's version arguments for it.
check_installs() {
  local label=$1 base="$ROOT/$WORK/venv-$1" venv extra torch_version
  shift
  step "[$label] a fresh venv with the wheel alone: torch 2.13.0 (CPU) first, then the wheel"
  "$PYTHON" -m venv "$base"
  quiet "$base/bin/python" -m pip install --upgrade "$@" pip
  quiet "$base/bin/python" -m pip install "$@" torch==2.13.0
  quiet "$base/bin/python" -m pip install "$@" "$wheel" torch==2.13.0
  quiet "$base/bin/python" -m pip check
  (cd "$WORK" && env -u PYTHONPATH "$base/bin/python" -I "$ROOT/scripts/package_smoke.py" core)
  if [ "$label" = latest ]; then
    step "[$label] [dev] and the extras together, resolved; the litgpt patches checked against the litgpt each gets"
    together "$base" dev &
    local dev_pid=$!
    together "$base" demo,hf,litgpt,loggers,rich
    wait "$dev_pid"
  fi
  for extra in "${EXTRAS[@]}"; do
    step "[$label] [$extra] alone, beside the wheel"
    venv="$base-$extra"
    cp -al "$base" "$venv"
    quiet "$venv/bin/python" -m pip install "$@" "$wheel[$extra]" torch==2.13.0
    quiet "$venv/bin/python" -m pip check
    (cd "$WORK" && env -u PYTHONPATH "$venv/bin/python" -I "$ROOT/scripts/package_smoke.py" "$extra")
    if [ "$extra" = litgpt ]; then
      env -u PYTHONPATH "$venv/bin/litgpt" --help >/dev/null
      echo "[smoke] litgpt: the litgpt command runs (litgpt --help)"
    fi
    torch_version=$("$venv/bin/python" -I -c "import torch; print(torch.__version__)")
    if [ "$torch_version" != 2.13.0+cpu ]; then
      echo "[package] installing [$extra] ($label) replaced the CPU torch 2.13.0 with torch $torch_version" >&2
      exit 1
    fi
    rm -rf "$venv"  # keeps the disk used to one extra's venv at a time
  done
}

# The two passes run side by side, each in a process of its own with its own log (pip is mostly one core's work and
# the disk's, so on 2 cores the pair takes little more than one pass alone: 3 min 22 s on 2026-12-03, against 5 min
# 45 s one pass after the other at bacfb26).
# Each log is shown once its pass ends; either pass failing fails the check.
check_installs pinned -c "$CONSTRAINTS" >"$WORK/pinned.log" 2>&1 &
pinned=$!
check_installs latest >"$WORK/latest.log" 2>&1 &  # no constraints: what `pip install "lightning-accum[<extra>]" torch==2.13.0` gets today
latest=$!
failed=0
wait "$pinned" || failed=1
cat "$WORK/pinned.log"
wait "$latest" || failed=1
cat "$WORK/latest.log"
if [ "$failed" -ne 0 ]; then
  echo "[package] a pass failed: its log is above" >&2
  exit 1
fi

rm -rf "$WORK"/venv* "$WORK/tools" "$WORK/sdist"  # 2 GB of venvs; the archives stay in $WORK/dist
step "done: the wheel and each extra work on their own, pinned and as pip resolves them today; torch 2.13.0+cpu kept"
