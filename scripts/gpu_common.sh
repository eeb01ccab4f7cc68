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

# Builds the extension in place, log in $OUT/build.log, unless SKIP_BUILD is set. In place, not
# `pip install -e`: pip's editable path wants build dependencies from an index.
build_in_place() {
  [ -n "${SKIP_BUILD:-}" ] && return 0
  if ! $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -50 "$OUT/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
}
