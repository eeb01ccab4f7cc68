#!/usr/bin/env bash
# Experiment (branch perf-epilogue, not main): the hidden layers' bias + ReLU in cuBLASLt's GEMM
# epilogue against the separate kernel. Tests of the forward's and the backward's users, then
# the step's kernel profile and the step benchmark with DQN_OPS_GEMM_EPILOGUE=1 (default) and 0.
# The branch also drops the backward's fill of the gradient buffer (the column-sum kernel zeroes
# the layout's gaps): in both runs; the profile shows the fill gone.
#   bash scripts/exp_epilogue.sh     # through the device tool; results under $OUT
source "$(dirname "$0")/gpu_common.sh"
build_in_place
$PY -m pytest -q -p no:cacheprovider tests/test_network.py tests/test_fused_step.py tests/test_trainer.py 2>&1 \
  | tail -15 | tee "$OUT/pytest.log"
for e in 1 0; do
  DQN_OPS_GEMM_EPILOGUE=$e $PY scripts/profile_step.py --out "$OUT/epilogue-$e" --batches 256 4096 2>&1 \
    | grep "B = " | tee "$OUT/profile-epilogue-$e.log"
  DQN_OPS_GEMM_EPILOGUE=$e $PY scripts/bench.py --out "$OUT/epilogue-$e" --batches 256 4096 --modes dqn_ops_graph \
    2>&1 | grep "B=" | tee "$OUT/bench-epilogue-$e.log"
done
(cd "$OUT" && tar czf logs.tar.gz ./*.log ./epilogue-* && rm -rf ./*.log ./epilogue-*)
