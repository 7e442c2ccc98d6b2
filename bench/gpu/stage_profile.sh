#!/usr/bin/env bash
# Where a GPU step's time goes (`rewind bench --stage-profile`, engine/src/gpu/forward.rs and ssm_layers.rs): each
# model of MODELS (arch:preset:layers, 0 layers = the preset's own depth; random weights, seed 7) in the replay form
# at BATCH, decode steps and verify steps of T = 4 at every kept count, launched eagerly with CUDA events between the
# stages; then, for the same models, the same bench with CUDA graphs (GRAPHS=1, the default), so the profile's eager
# steps can be set beside the steps users get.
#
# Carried: .gpu/prof/rewind.xz (`cargo build --release -p rewind-bin --no-default-features --features cuda`, stripped,
# xz-compressed). Everything comes back as one file, $OUT/prof.tgz (a call brings back only so many files), plus
# run.log and the stage lines in stages.txt.
set -u
. bench/gpu/lib.sh
unpack_bin ${BIN:-.gpu/prof/rewind.xz}
out_dir prof
trap 'cp $D/run.log $OUT/ 2>/dev/null; grep -h "by stage" $D/*.log > $OUT/stages.txt 2>/dev/null; tar -C $OUT -czf $OUT/prof.tgz prof && rm -rf $D' EXIT

for spec in ${MODELS:-qwen3_5:qwen3.5-4b:0 nemotron_h:nemotron-h-8b:0}; do
  init_model $R $spec
  common="--device cuda --model $m --decode replay --batch ${BATCH:-64,256} --prompt-len 1024 --step-prompt 16
    --decode-tokens 16 --verify-window 4"
  f=$D/$preset-$layers-profile
  timeout ${PROFILE_S:-120} $R bench $common --repeats 1 --no-cuda-graphs --stage-profile --json $f.json > $f.md 2> $f.log
  stamp "profile $preset $layers" $?
  if [ "${GRAPHS:-1}" = 1 ]; then
    f=$D/$preset-$layers-graphs
    timeout ${GRAPHS_S:-120} $R bench $common --repeats 3 --json $f.json > $f.md 2> $f.log
    stamp "graphs $preset $layers" $?
  fi
done
