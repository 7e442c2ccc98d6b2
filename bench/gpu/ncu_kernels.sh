#!/usr/bin/env bash
# Hardware counters of rewind's kernels with Nsight Compute, for the "ncu counters where they work" of issues 15 and
# 17: `rewind bench kernels` (one timed launch a case after its warm-ups) under `ncu`, keeping the launches whose
# kernel name matches KERNELS (default: the replay kernels), with the sections that say why a kernel is slow —
# speed of light (DRAM / SM throughput), occupancy (and what limits it: registers, shared memory, block size),
# launch statistics (registers a thread, shared memory a block) and warp state (stall reasons). Clocks are left alone
# (`--clock-control none`), as the device notes ask. ncu reads counters on the Firecracker machines only (gVisor:
# "LibraryNotLoaded"); the script records ncu's own message either way.
# Carried: the binary as .gpu/x1/rewind.xz (see x1_evidence.sh). Everything comes back as $OUT/ncu.tgz.
# Written 2026-11-26 after that session's device time was spent: not yet run.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
xz -dc ${REWIND_XZ:-.gpu/x1/rewind.xz} > /tmp/rewind && chmod +x /tmp/rewind
D=$OUT/ncu
mkdir -p $D
trap 'tar -C $OUT -czf $OUT/ncu.tgz ncu && rm -rf $D' EXIT
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}" > $D/run.log
uname -r >> $D/run.log
[ -n "$NCU" ] || exit 0
for fam in ${FAMILIES:-gdn mamba2}; do
  timeout ${NCU_S:-240} $NCU --clock-control none -k "regex:${KERNELS:-replay}" --launch-count ${LAUNCHES:-200} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \
    /tmp/rewind bench kernels --device cuda --family $fam --batch ${BATCH:-64,256} --repeats 1 \
    > $D/ncu-$fam.csv 2> $D/ncu-$fam.log
  echo "ncu $fam rc $?" >> $D/run.log
done
