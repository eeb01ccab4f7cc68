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
#   NCU_SOURCE='spectral_norm_cluster adam_update' bash scripts/ncu_step.sh
#       # also each named kernel's source page (per SASS line: instructions, stall samples) as
#       # $OUT/ncu-source-<kernel>.csv.gz, for scripts/ncu_source_lines.py
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
if [ -n "${NCU_SOURCE:-}" ]; then
  # A second pass, every section and the source correlation, sampling warps as often as ncu can
  # (the step's tail kernels last a few µs each).
  regex="regex:$(echo $NCU_SOURCE | tr ' ' '|')"
  ncu --clock-control none --profile-from-start off --kernel-name "$regex" --set full --import-source yes \
    --warp-sampling-interval 0 -f -o "$OUT/ncu-source" \
    $PY scripts/ncu_driver.py --batch "$B" --network "$NETWORK" > "$OUT/ncu-source.log" 2>&1 || rc=1
  for k in $NCU_SOURCE; do
    ncu -i "$OUT/ncu-source.ncu-rep" --kernel-name "regex:$k" --page source --csv --print-source cuda,sass \
      2>> "$OUT/ncu-source.log" | gzip > "$OUT/ncu-source-$k.csv.gz"
    echo "== $k (scripts/ncu_source_lines.py)"
    $PY scripts/ncu_source_lines.py "$OUT/ncu-source-$k.csv.gz" --top 25 || rc=1
  done
  rm -f "$OUT/ncu-source.ncu-rep"
fi
grep -E "^  [a-zA-Z_].*\(|Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall" \
  "$OUT/$NAME" | head -200
exit $rc
