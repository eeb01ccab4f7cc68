#!/usr/bin/env bash
# Nsight Compute counters for the kernels of one dqn_ops training step (eager: the same kernels
# the CUDA graph replays), on a GPU machine whose runtime lets ncu read the counters (see the
# device tool's KINDS.md). Clocks are left alone (--clock-control none). Builds in place first
# unless SKIP_BUILD is set. Writes $OUT/ncu-B<batch>.txt (default OUT: ./gpu_out), or
# ncu-<network>-B<batch>.txt for another network than the reference.
#
#   bash scripts/ncu_step.sh                       # B = 256, every kernel of the step
#   NCU_BATCH=4096 NCU_KERNELS='regex:dqn_loss|spectral' bash scripts/ncu_step.sh
#   NCU_EXTRA="--section SourceCounters" bash scripts/ncu_step.sh   # more sections (ncu --list-sections)
#   NCU_NETWORK=qr_dqn_200 NCU_BATCH=4096 bash scripts/ncu_step.sh   # a network of bench_networks.py
source "$(dirname "$0")/gpu_common.sh"
build_in_place
B=${NCU_BATCH:-256}
NETWORK=${NCU_NETWORK:-reference}
NAME=ncu-B$B.txt
if [ "$NETWORK" != reference ]; then NAME=ncu-$NETWORK-B$B.txt; fi
# Only the profiled step (between cudaProfilerStart/Stop in ncu_driver.py) is measured.
ncu --clock-control none --profile-from-start off --kernel-name "${NCU_KERNELS:-regex:.*}" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
  $PY scripts/ncu_driver.py --batch "$B" --network "$NETWORK" > "$OUT/$NAME" 2>&1
rc=$?
grep -E "^  [a-zA-Z_].*\(|Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall" \
  "$OUT/$NAME" | head -200
exit $rc
