#!/usr/bin/env bash
# Builds the extension on this (CPU) machine against the GPU machine's torch, so that a device
# call carries the build instead of compiling it there (~100 s of device time a cold call, ~150 s
# with an A/B's base tree beside it). The build of tree DIR goes to DIR/.prebuilt (the module
# stripped of its host debug sections, _build_info.py and the stamp gpu_common.sh's tree_stamp
# computes); on the GPU machine build_in_place (and gpu_check.sh for AB_BASE) takes it where the
# stamp is still the tree's and the torch there, else compiles as before.
#
#   bash scripts/prebuild.sh              # this tree: carry [".prebuilt"] in the device call
#   bash scripts/prebuild.sh .base/head   # a base tree for AB_BASE: carry [".base"]
#
# The GPU machine's torch (its version in bench/logs/env.txt) is installed once into .venv-device
# from PyPI (a CUDA 13 build, several GB): python3 -m venv .venv-device && .venv-device/bin/pip
# install torch==2.11.0 ninja setuptools wheel. The build takes ~9 minutes on two cores; it runs
# in a copy of the tree, leaving this tree's own build alone.
set -euo pipefail
DIR=$(realpath "${1:-.}")
ROOT=$(realpath "$(dirname "$0")/..")
PYTHON=${PYTHON:-$ROOT/.venv-device/bin/python}
[ -x "$PYTHON" ] || { echo "no $PYTHON: make .venv-device first (this script's header)"; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/tree"
cp -r "$DIR/csrc" "$DIR/dqn_ops" "$DIR/setup.py" "$WORK/tree/"
rm -f "$WORK/tree/dqn_ops/"*.so "$WORK/tree/dqn_ops/_build_info.py"
# The GPU machine's environment sets TORCH_CUDA_ARCH_LIST=9.0a (its build.log), which the stamp
# includes: build for that unless told otherwise.
export OUT="$WORK/out" PYTHON TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
source "$ROOT/scripts/gpu_common.sh"  # the build settings, $PY, tree_stamp; cds to $ROOT
(cd "$WORK/tree" && MAX_JOBS=${MAX_JOBS_HERE:-2} $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1) \
  || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
mkdir -p "$DIR/.prebuilt"
strip --strip-debug -o "$DIR/.prebuilt/_C.abi3.so" "$WORK/tree/dqn_ops/_C.abi3.so"
cp "$WORK/tree/dqn_ops/_build_info.py" "$DIR/.prebuilt/"
tree_stamp "$WORK/tree" > "$DIR/.prebuilt/stamp"  # the sources built, whatever changed in DIR since
echo "$DIR/.prebuilt: $(du -h "$DIR/.prebuilt/_C.abi3.so" | cut -f1), stamp $(cut -c1-12 "$DIR/.prebuilt/stamp")"
