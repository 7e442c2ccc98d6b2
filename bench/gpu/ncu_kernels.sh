#!/usr/bin/env bash
# Hardware counters of rewind's kernels with Nsight Compute, for the "ncu counters where they work" of issues 15 and
# 17: `rewind bench kernels` (one timed launch a case after its warm-ups) under `ncu`, keeping the launches whose
# kernel name matches KERNELS (default: the replay kernels), with the sections that say why a kernel is slow —
# speed of light (DRAM / SM throughput), occupancy (and what limits it: registers, shared memory, block size),
# launch statistics (registers a thread, shared memory a block) and warp state (stall reasons). Clocks are left alone
# (`--clock-control none`), as the device notes ask. ncu reads counters on the Firecracker machines only (gVisor:
# "LibraryNotLoaded"); the script records ncu's own message either way.
# FAMILIES picks the replay families (`gdn mamba2`, or none); ATTENTION=1 also profiles the tensor-core attention
# kernels (attn_flash_*) under `cuda_timing attention` (issue 15's decode and prefill rows).
# Carried: the binary as .gpu/x1/rewind.xz (see x1_evidence.sh) and, for ATTENTION=1, .gpu/attn/cuda_timing.xz
# (`cargo build --release -p rewind-kernels --example cuda_timing`, stripped, xz-compressed). Everything comes back
# as $OUT/ncu.tgz; bench/gpu/ncu_summary.py turns the CSVs into tables.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -z "${FAMILIES-gdn mamba2}" ] || { xz -dc ${REWIND_XZ:-.gpu/x1/rewind.xz} > /tmp/rewind && chmod +x /tmp/rewind; }
D=$OUT/ncu
mkdir -p $D
trap 'tar -C $OUT -czf $OUT/ncu.tgz ncu && rm -rf $D' EXIT
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}" > $D/run.log
uname -r >> $D/run.log
[ -n "$NCU" ] || exit 0
for fam in ${FAMILIES-gdn mamba2}; do
  timeout ${NCU_S:-240} $NCU --clock-control none -k "regex:${KERNELS:-replay}" --launch-count ${LAUNCHES:-200} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \
    /tmp/rewind bench kernels --device cuda --family $fam --batch ${BATCH:-64,256} --repeats 1 \
    > $D/ncu-$fam.csv 2> $D/ncu-$fam.log
  echo "ncu $fam rc $?" >> $D/run.log
done
if [ "${ATTENTION:-0}" = 1 ]; then
  xz -dc ${TIMING_XZ:-.gpu/attn/cuda_timing.xz} > /tmp/cuda_timing && chmod +x /tmp/cuda_timing
  timeout ${NCU_S:-240} $NCU --clock-control none -k "regex:attn_flash" --launch-count ${ATTN_LAUNCHES:-300} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \
    /tmp/cuda_timing attention > $D/ncu-attention.csv 2> $D/ncu-attention.log
  echo "ncu attention rc $?" >> $D/run.log
  # Stall reasons per issued instruction (the warp-state section's details page gives only their sum).
  M=smsp__average_warps_issue_stalled_
  timeout ${NCU_S:-240} $NCU --clock-control none -k "regex:attn_flash" --launch-count ${ATTN_LAUNCHES:-300} --csv \
    --page raw --metrics $(for r in long_scoreboard short_scoreboard barrier mio_throttle wait math_pipe_throttle \
      lg_throttle not_selected selected dispatch_stall no_instruction; do printf "${M}${r}_per_issue_active.ratio,"; \
      done)sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    /tmp/cuda_timing attention > $D/ncu-attention-stalls.csv 2> $D/ncu-attention-stalls.log
  echo "ncu attention stalls rc $?" >> $D/run.log
fi
