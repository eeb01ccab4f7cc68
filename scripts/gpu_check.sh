#!/usr/bin/env bash
# Build the extension on a GPU machine, run the whole test suite (GPU tests included) and a
# quick benchmark. Logs and result files go under $OUT (default ./gpu_out).
#
#   bash scripts/gpu_check.sh            # everything
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
#   SKIP_TESTS=1 SKIP_BENCH=1 PROFILE=1 bash scripts/gpu_check.sh   # a part alone (build, then the profile)
#   DQN_OPS_TEST_CUDA_ONLY=1 PYTEST_ARGS="-q -n 15 -p xdist tests" SKIP_BENCH=1 bash scripts/gpu_check.sh
#       # only the tests that touch CUDA (tests/conftest.py; CI runs every CPU test): the suite's
#       # GPU part in one device call
#   DQN_OPS_TEST_SHARD=0/2 PYTEST_ARGS="-q -n 15 -p xdist tests" SKIP_BENCH=1 bash scripts/gpu_check.sh
#       # half the suite (tests/conftest.py); the whole suite and the build exceed one device call,
#       # so the other half (1/2) in a second call, SKIP_BUILD=1 while the machine is still warm
#   PYTEST_ARGS=tests/test_spectral_norm.py BENCHES="spectral" bash scripts/gpu_check.sh
#   PYTEST_ARGS='-q tests/test_qr.py -k "graphed or poison"' SKIP_BENCH=1 bash scripts/gpu_check.sh
#       # PYTEST_ARGS is split as the shell splits a command line, so quotes group words
#   TRAIN_EPOCHS=5 bash scripts/gpu_check.sh     # also a short training run per backend
#   PARITY_EPOCHS=50 bash scripts/gpu_check.sh   # also the convergence-parity check
#   PARITY_EPOCHS=50 PARITY_ARGS="--seeds 0 1 2 3 4 5 --jobs 6" bash scripts/gpu_check.sh   # more seeds, runs at once
#   PARITY_EPOCHS=50 PARITY_ARGS="--name parity-qr" PARITY_TRAIN_ARGS="--loss-type qr --atoms 200" bash scripts/gpu_check.sh
#   BENCHES=step STEP_BENCH_ARGS="--batches 256 4096" bash scripts/gpu_check.sh   # the whole-step benchmark
#   BENCHES=batch_networks bash scripts/gpu_check.sh   # the trainer's batched online + target layers vs two passes
#   BENCHES=loop LOOP_BENCH_ARGS="--prioritized --n-step 3" bash scripts/gpu_check.sh   # the training loop (bench_loop.py)
#   BENCHES=networks NETWORKS_BENCH_ARGS="--networks iqn_32 --merge bench/results/networks.json" bash scripts/gpu_check.sh
#       # one network of bench_networks.py again, the others' rows kept from the committed file
#   SANITIZE=1 bash scripts/gpu_check.sh         # also scripts/verify_gpu.sh (compute-sanitizer, 4 tools)
#   DIST=1 bash scripts/gpu_check.sh             # on a multi-GPU machine: data-parallel scaling, 1 vs all GPUs
#   NCU=1 NCU_BATCH=256 bash scripts/gpu_check.sh  # also scripts/ncu_step.sh (Nsight Compute counters per kernel)
#   NCU=1 NCU_NETWORK=qr_dqn_200 NCU_BATCH=4096 NCU_KERNELS='regex:dueling|dqn_loss' bash scripts/gpu_check.sh
#       # ... of another network of bench_networks.py, some kernels
#   PROFILE=1 bash scripts/gpu_check.sh          # also scripts/profile_step.py (every kernel of the step, timed)
#   PROFILE=1 PROFILE_NETWORK=cleanrl_c51 bash scripts/gpu_check.sh   # ... of another network of bench_networks.py
#   SOAK=1 bash scripts/gpu_check.sh             # also scripts/soak.py (100,000 graphed + 10,000 eager steps)
#   AB_BASE=.base bash scripts/gpu_check.sh      # also the graphed step of the tree in .base vs this one, timed
#       alternately (scripts/bench_ab.py); make .base first: git archive <commit> csrc dqn_ops scripts setup.py | tar -x -C .base
#       (a base from before the side streams were on by default: AB_ARGS="--base-env DQN_OPS_SIDE_STREAM=1")
#   AB_BASE=. AB_ARGS="--base-env DQN_OPS_SIDE_STREAM=0 --networks reference iqn_32 --name step-ab-side-stream" bash scripts/gpu_check.sh
#       # this tree against itself under a run-time switch (no second build), several networks in one file
# Sanitizers: scripts/verify_gpu.sh. The build is skipped where scripts/prebuild.sh left this
# tree's (or AB_BASE's) build in .prebuilt and the call carries it (carry [".prebuilt"], or
# [".base"] for a base tree's).
#
# Training runs go to $OUT/runs.tar.gz (metrics.csv, summary.json, learning_curve.png; not the checkpoints),
# the logs (env, build, pytest, benchmarks) to $OUT/logs.tar.gz (logs-2.tar.gz, ... for later runs in one call).
#
# This is exactly what runs on the H200 through the device tool (its python3 has torch,
# nvcc, pytest and ninja; nothing can be downloaded there).
source "$(dirname "$0")/gpu_common.sh"

# The logs in one archive at any exit, a call's `timeout` included (its TERM reaches this script's
# process group): the device tool brings back at most 8 files from $OUT. A second run of this
# script in the same call (SKIP_BUILD=1 ...) archives to logs-2.tar.gz, and so on, rather than
# over the first run's logs.
logs_archive=logs.tar.gz
for n in 2 3 4 5 6 7 8 9; do
  [ -e "$OUT/$logs_archive" ] || break
  logs_archive=logs-$n.tar.gz
done
archive() {
  trap - EXIT TERM
  if [ -d runs ]; then tar czf "$OUT/runs.tar.gz" --exclude='*.log' --exclude='*.pt' runs; fi  # files come back only up to 16 MiB
  (cd "$OUT" && shopt -s nullglob && files=(env.txt ./*.log) && [ -e env.txt ] && tar czf "$logs_archive" "${files[@]}" \
     && rm -f "${files[@]}")
}
trap archive EXIT
trap 'echo "== cut by a signal: the logs so far are in $logs_archive"; archive; exit 143' TERM
other_rc=0  # a failed part besides the tests (the A/B, a benchmark, the sanitizers) fails the call too

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== build"
# The base tree builds beside this one (the machine has the cores for both), unless it is this one.
if [ -n "${AB_BASE:-}" ] && [ "$(realpath "$AB_BASE")" != "$(realpath .)" ]; then
  (use_prebuilt "$AB_BASE" || (cd "$AB_BASE" && MAX_JOBS=8 $PY setup.py build_ext --inplace)) > "$OUT/build-base.log" 2>&1 &
  base_build=$!
fi
build_in_place
$PY -c "import dqn_ops; assert dqn_ops.cuda_kernels_built(), 'built without CUDA kernels'; print('CUDA kernels built')" || exit 1

if [ -n "${AB_BASE:-}" ]; then  # before the tests: the machine is otherwise idle
  echo "== base vs this tree, graphed step (scripts/bench_ab.py)"
  if [ -z "${base_build:-}" ] || wait "$base_build"; then
    $PY scripts/bench_ab.py --base "$AB_BASE" --out "$OUT" ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.log" | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || other_rc=1
  else
    tail -30 "$OUT/build-base.log"; echo "BASE BUILD FAILED"; other_rc=1
  fi
fi

test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== tests"
  # PYTEST_ARGS sets the verbosity too: a -q before it would cancel its -v. Failing tests are
  # named in pytest-failures.log as they fail (tests/conftest.py), so a run cut short by the
  # device call's limit still says which; a hung test is cut by pytest-timeout where it is
  # installed (PYTEST_TIMEOUT seconds a test) and named.
  timeout_args=()
  if $PY -c "import pytest_timeout" 2> /dev/null; then timeout_args=(--timeout "${PYTEST_TIMEOUT:-300}"); fi
  : > "$OUT/pytest-failures.log"
  eval "pytest_args=(${PYTEST_ARGS:--q tests})"  # quotes in PYTEST_ARGS group words (a -k expression)
  DQN_OPS_FAILURE_LOG="$OUT/pytest-failures.log" $PY -m pytest -rfEs -p no:cacheprovider ${timeout_args[@]+"${timeout_args[@]}"} \
    "${pytest_args[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -40
  test_rc=${PIPESTATUS[0]}
  if [ -s "$OUT/pytest-failures.log" ]; then echo "== failed tests"; cat "$OUT/pytest-failures.log"; fi
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== benchmark"
  for b in ${BENCHES:-network optim spectral}; do  # "step": the whole-step benchmark, scripts/bench.py
    script="scripts/bench_$b.py" extra=""
    if [ "$b" = step ]; then script=scripts/bench.py extra="${STEP_BENCH_ARGS:-}"; fi
    if [ "$b" = loop ]; then extra="${LOOP_BENCH_ARGS:-}"; fi
    if [ "$b" = networks ]; then extra="${NETWORKS_BENCH_ARGS:-}"; fi
    $PY "$script" --out "$OUT" $extra || echo "BENCHMARK $b FAILED"
  done 2>&1 | tee "$OUT/bench.log" | tail -60
  if grep -q "BENCHMARK .* FAILED" "$OUT/bench.log"; then other_rc=1; fi
fi
if [ -n "${SANITIZE:-}" ]; then
  echo "== compute-sanitizer (scripts/verify_gpu.sh)"
  SKIP_BUILD=1 OUT="$OUT" bash scripts/verify_gpu.sh 2>&1 | tee "$OUT/verify.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then echo "SANITIZER FOUND ERRORS"; other_rc=1; fi
fi
if [ -n "${DIST:-}" ]; then
  gpus=$(nvidia-smi -L | wc -l)
  echo "== data-parallel scaling, 1 and $gpus GPUs (scripts/bench_distributed.py)"
  for w in 1 "$gpus"; do
    $PY -m torch.distributed.run --nproc-per-node "$w" scripts/bench_distributed.py --out "$OUT" \
      --batches ${DIST_BATCHES:-4096 65536} || echo "DISTRIBUTED BENCHMARK FAILED (world $w)"
  done 2>&1 | tee "$OUT/distributed.log" | tail -8
  $PY scripts/bench_distributed.py --merge "$OUT" 2>&1 | tail -12
fi
if [ -n "${NCU:-}" ]; then
  echo "== Nsight Compute (scripts/ncu_step.sh, ${NCU_NETWORK:-reference}, B = ${NCU_BATCH:-256})"
  SKIP_BUILD=1 OUT="$OUT" bash scripts/ncu_step.sh 2>&1 | tail -60 | tee "$OUT/ncu-summary.log"
fi
if [ -n "${PROFILE:-}" ]; then
  echo "== kernel trace of the step"
  $PY scripts/profile_step.py --out "$OUT" --batches ${PROFILE_BATCHES:-256 4096} --network "${PROFILE_NETWORK:-reference}" 2>&1 | tee "$OUT/profile.log" | tail -8
fi
if [ -n "${TRAIN_EPOCHS:-}" ]; then
  echo "== training (${TRAIN_EPOCHS} epochs x 300 steps, B=256)"
  for backend in dqn_ops torch; do
    $PY scripts/train.py --backend "$backend" --epochs "$TRAIN_EPOCHS" --quiet --out "runs/train-$backend" \
      > "runs-train-$backend.log" 2>&1 || echo "TRAINING $backend FAILED"
    tail -3 "runs-train-$backend.log"
  done 2>&1 | tee "$OUT/train.log"
fi
if [ -n "${PARITY_EPOCHS:-}" ]; then
  echo "== convergence parity (${PARITY_EPOCHS} epochs)"
  timeout "${PARITY_TIMEOUT:-3600}" $PY scripts/parity.py --epochs "$PARITY_EPOCHS" --out "$OUT" --runs runs/parity ${PARITY_ARGS:-} \
    ${PARITY_TRAIN_ARGS:+--train-args "$PARITY_TRAIN_ARGS"} 2>&1 | tee "$OUT/parity.log" | tail -20
fi
if [ -n "${SOAK:-}" ]; then
  echo "== soak"
  $PY scripts/soak.py --out "$OUT" ${SOAK_ARGS:-} 2>&1 | tail -5 | tee "$OUT/soak.log"
fi
archive
if [ "$test_rc" -ne 0 ]; then exit "$test_rc"; fi
exit "$other_rc"
