#!/usr/bin/env bash
# Where the replay kernels' warps stall, instruction by instruction: Nsight Compute's source counters (sampled warp
# stall reasons per SASS instruction) of one plain replay step (L = 16) and one verify of T = 4 per family, at batch
# BATCH (default 256), out of `rewind bench kernels`. The kernels are compiled with -lineinfo
# (REWIND_NVRTC_LINEINFO=1), so each instruction carries its source line. Exported per case with `--page source
# --print-source sass` as CSV (xz-compressed) beside the report's details page; the .ncu-rep files stay on the device
# unless KEEP_REP=1.
#
# Which launches: with --repeats 1 every case of `rewind bench kernels` is 3 warm-up launches and 1 timed one, in the
# order of its table (recurrent rows through the replay kernel, replay L = 4, 8, 16, 32, flush steps L = 4 … 32,
# verify T = 2, 4, 6, …: Sweep::kernels), so among the launches matching `replay` the 16th is replay L = 16's timed
# one and the 44th verify T = 4's. CASES overrides the list of NAME:SKIP pairs.
#
# Carried: the stripped release build as .gpu/one/rewind.xz, and beside it kcache.tar.xz filled with
# `REWIND_NVRTC_LINEINFO=1 rewind compile-kernels --arch sm_90 --fill-cache` (else the kernels compile on the device,
# about a minute). Everything comes back as $OUT/ncu-source.tgz.
set -u
. bench/gpu/lib.sh
unpack_bin ${REWIND_XZ:-.gpu/one/rewind.xz}
export REWIND_NVRTC_LINEINFO=1
out_dir ncu-source
trap 'tar -C $OUT -czf $OUT/ncu-source.tgz ncu-source && rm -rf $D' EXIT
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}" >> $L
[ -n "$NCU" ] || exit 0
for fam in ${FAMILIES:-mamba2 gdn}; do
  for spec in ${CASES:-replay-l16:15 verify-t4:43}; do
    name=${spec%%:*}
    skip=${spec#*:}
    f=$D/$fam-$name
    timeout ${NCU_S:-150} $NCU --clock-control none -k "regex:replay" --launch-skip $skip --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy -o $f -f \
      $R bench kernels --device cuda --family $fam --batch ${BATCH:-256} --repeats 1 > $f.log 2>&1
    stamp "ncu $fam $name" $?
    $NCU -i $f.ncu-rep --page details --csv > $f-details.csv 2>> $f.log
    $NCU -i $f.ncu-rep --page source --csv --print-source sass > $f-sass.csv 2>> $f.log
    stamp "export $fam $name" $?
    xz -9 $f-sass.csv
    [ "${KEEP_REP:-0}" = 1 ] && xz -9 $f.ncu-rep || rm -f $f.ncu-rep
  done
done
