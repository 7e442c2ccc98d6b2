#!/usr/bin/env bash
# Whole steps of two builds side by side: the self-test of the last build (and, unless COLS_MAP=0, its model-level
# rows again with every column selection through an index map, the tensor-parallel path), then for each model of
# MODELS (arch:preset:layers, 0 = the preset's depth; random weights, seed 7) the replay-form bench with CUDA graphs of
# every build in turn (decode at BATCH, verify T = 4 at every kept count, and the chunked prefill of one prompt;
# medians of 3), and with PROFILE=1 the eager stage profile of every build (`--stage-profile`). The same arguments as
# bench/gpu/stage_profile.sh, so its tables compare. BENCH_ARGS adds bench flags (e.g. `--decode-steps 8`: every decode
# row in single steps and in chains of 8).
#
# Carried: .gpu/prof/bins.tar.xz, the stripped release builds named by VARIANTS (default "before after") in one tar
# (bench/gpu/build_ab.sh makes it; its 64 MiB dictionary keeps two builds near the size of one, which a call's carry
# needs beside the tracked default models). Everything comes back as $OUT/ab.tgz, plus run.log and the
# decode / verify lines of every bench in lines.txt.
set -u
. bench/gpu/lib.sh
VARIANTS=${VARIANTS:-before after}
LAST=${VARIANTS##* }
xz -dc ${BINS:-.gpu/prof/bins.tar.xz} | tar -C /tmp -xf - $VARIANTS
for v in $VARIANTS; do chmod +x /tmp/$v; done
use_kcache $(dirname ${BINS:-.gpu/prof/bins.tar.xz})/kcache.tar.xz
out_dir ab
trap 'cp $D/run.log $OUT/ 2>/dev/null; grep -H "^| \(decode\|verify\)" $D/*.md > $OUT/lines.txt 2>/dev/null; grep -h "by stage" $D/*.log >> $OUT/lines.txt 2>/dev/null; tar -C $OUT -czf $OUT/ab.tgz ab && rm -rf $D' EXIT

if [ "${SELFTEST:-1}" = 1 ]; then
  # FIXTURES picks the fixture models of the model-level check (a glob under tests/fixtures; default all of them).
  mkdir -p /tmp/fixtures
  for f in tests/fixtures/${FIXTURES:-*}/; do ln -sfn $PWD/$f /tmp/fixtures/$(basename $f); done
  timeout ${SELFTEST_S:-240} /tmp/$LAST selftest --device cuda --fixtures /tmp/fixtures --trained-models models/default \
    --json $D/selftest-$LAST.json > $D/selftest-$LAST.log 2>&1
  stamp "selftest $LAST" $?
  tail -5 $D/selftest-$LAST.log >> $L
fi
if [ "${COLS_MAP:-1}" = 1 ]; then
  # The tensor-parallel column path on one GPU: every column selection through an index map (REWIND_COLS_MAP=1),
  # checked by the model-level rows of one fixture per family and the trained models (the op cases are skipped by
  # --only; the gathers are among them in the run above).
  mkdir -p /tmp/fixtures-map
  for f in nemotron_h_dense qwen3_5; do ln -sfn $PWD/tests/fixtures/$f /tmp/fixtures-map/$f; done
  REWIND_COLS_MAP=1 timeout ${COLS_MAP_S:-150} /tmp/$LAST selftest --device cuda --only copy_cols \
    --fixtures /tmp/fixtures-map --trained-models models/default --json $D/selftest-cols-map-$LAST.json \
    > $D/selftest-cols-map-$LAST.log 2>&1
  stamp "selftest with index maps $LAST" $?
  tail -2 $D/selftest-cols-map-$LAST.log >> $L
fi
for spec in ${MODELS:-nemotron_h:nemotron-h-8b:0 qwen3_5:qwen3.5-4b:0}; do
  init_model /tmp/$LAST $spec
  common="--device cuda --model $m --decode replay --batch ${BATCH:-64,256} --prompt-len 1024 --step-prompt 16
    --decode-tokens 16 --verify-window 4 ${BENCH_ARGS:-}"
  for v in $VARIANTS; do
    f=$D/$preset-$layers-graphs-$v
    timeout ${GRAPHS_S:-150} /tmp/$v bench $common --repeats 3 --json $f.json > $f.md 2> $f.log
    stamp "graphs $preset $layers $v" $?
  done
  if [ "${PROFILE:-0}" = 1 ]; then
    for v in $VARIANTS; do
      f=$D/$preset-$layers-profile-$v
      timeout ${PROFILE_S:-120} /tmp/$v bench $common --repeats 1 --no-cuda-graphs --stage-profile --json $f.json \
        > $f.md 2> $f.log
      stamp "profile $preset $layers $v" $?
    done
  fi
  rm -rf $m
done
