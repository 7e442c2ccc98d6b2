#!/usr/bin/env bash
# Per-kernel device times of whole bench steps, to split the stage profile's stages (`bench/gpu/stage_profile.sh`)
# into their kernels: random models of MODELS (arch:preset:layers; few layers, the real shapes), the replay form at
# BATCH, decode and verify T = 4 steps, launched eagerly, under Nsight Systems' CUDA trace when it is installed (its
# kernel summary), else under Nsight Compute with the duration metric only (`--cache-control none`, so caches stay
# warm as in a real step). The prompts come first and take many launches: LAUNCH_SKIP skips that many unprofiled
# (Nemotron-H-8B at 4 layers reached its first batch-256 decode step after about 11 600; Qwen3.5-4B's prompts took
# more than 20 000). Everything comes back as $OUT/ktimes.tgz plus the summaries in summary.txt.
#
# Carried: .gpu/prof/rewind.xz (as for stage_profile.sh).
set -u
. bench/gpu/lib.sh
unpack_bin ${BIN:-.gpu/prof/rewind.xz}
out_dir ktimes
trap 'cp $D/summary.txt $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/ktimes.tgz ktimes && rm -rf $D' EXIT

NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}; ncu: ${NCU:-none}" | tee $D/summary.txt
for spec in ${MODELS:-nemotron_h:nemotron-h-8b:4 qwen3_5:qwen3.5-4b:4}; do
  init_model $R $spec
  args="bench --device cuda --model $m --decode replay --batch ${BATCH:-256} --prompt-len 1024 --step-prompt 16
    --decode-tokens 16 --verify-window 4 --repeats 1 --no-cuda-graphs"
  f=$D/$preset-$layers
  if [ -n "$NSYS" ]; then
    timeout ${PROF_S:-200} $NSYS profile -t cuda -o $f --force-overwrite true $R $args > $f.out 2>&1
    echo "== $preset $layers layers: nsys rc $?" >> $D/summary.txt
    $NSYS stats -r cuda_gpu_kern_sum -f csv -o $f $f.nsys-rep >> $f.out 2>&1
    head -60 ${f}_cuda_gpu_kern_sum.csv >> $D/summary.txt
  elif [ -n "$NCU" ]; then
    timeout ${PROF_S:-200} $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --launch-skip ${LAUNCH_SKIP:-0} --launch-count ${LAUNCHES:-4000} --csv --page raw $R $args > $f.csv 2> $f.log
    echo "== $preset $layers layers: ncu rc $?" >> $D/summary.txt
  fi
done
