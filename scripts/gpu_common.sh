# Sourced by the GPU scripts (gpu_check.sh, verify_gpu.sh, ncu_step.sh): the repository root
# as working directory and on PYTHONPATH, $OUT (default ./gpu_out), the build settings, NVLink
# multicast off for every NCCL / PyTorch / NVSHMEM user (the device tool's KINDS.md), $PY, and
# build_in_place.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}

# What a build of the tree in $1 depends on, as one hash: its sources and setup.py, the torch and
# CUDA versions $PY has (without torch's local label: the CPU machine's PyPI build of a release
# and the GPU machine's are the same ABI), the architectures and nvcc.
tree_stamp() {
  (cd "$1" && {
    find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum
    $PY -c "import torch; print(torch.__version__.split('+')[0], torch.version.cuda)"
    echo "$TORCH_CUDA_ARCH_LIST"
    nvcc --version | tail -1
  } | sha256sum | cut -d' ' -f1)
}

# Takes the build that scripts/prebuild.sh left in $1/.prebuilt where its stamp is the tree's
# here (saving the device call its ~100 s of compiling), and the module imports with its kernels;
# else returns 1 and leaves no copy behind.
use_prebuilt() {
  local dir=$1
  [ -f "$dir/.prebuilt/stamp" ] || return 1
  if [ "$(cat "$dir/.prebuilt/stamp")" != "$(tree_stamp "$dir")" ]; then
    echo "$dir/.prebuilt: built from another tree or torch; building"
    return 1
  fi
  cp "$dir/.prebuilt/_C.abi3.so" "$dir/.prebuilt/_build_info.py" "$dir/dqn_ops/" || return 1
  if ! (cd "$dir" && PYTHONPATH=. $PY -c "import dqn_ops; assert dqn_ops.cuda_kernels_built()"); then
    rm -f "$dir/dqn_ops/_C.abi3.so" "$dir/dqn_ops/_build_info.py"
    echo "$dir/.prebuilt: does not import here; building"
    return 1
  fi
  echo "$dir/.prebuilt: taken (scripts/prebuild.sh)"
}

# Builds the extension in place, log in $OUT/build.log, unless SKIP_BUILD is set or a prebuilt
# copy of this tree's build is here (use_prebuilt). In place, not `pip install -e`: pip's
# editable path wants build dependencies from an index.
build_in_place() {
  [ -n "${SKIP_BUILD:-}" ] && return 0
  if use_prebuilt . > "$OUT/build.log" 2>&1; then cat "$OUT/build.log"; return 0; fi
  if ! $PY setup.py build_ext --inplace >> "$OUT/build.log" 2>&1; then
    tail -50 "$OUT/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
}
