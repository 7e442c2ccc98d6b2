#!/usr/bin/env bash
# Serving with chained verifies (issue 10 item 4): `rewind bench --serving-only --spec oracle:P` (greedy requests,
# T = 4, plain and speculative side by side in one run) with --decode-steps 1 (one verify per engine step) and 8
# (verifies chained on the device), on SERVE_MODELS (arch:preset:layers) at concurrency SERVE_CONC. TEMP > 0 samples
# every request at that temperature (fixed seeds; verifies judged from the one-pass summaries, chained with the
# device keying each later step's noise). TP > 1 runs tensor-parallel over that many GPUs.
# Carried: .gpu/one/rewind.xz and .gpu/one/kcache.tar.xz. Everything comes back as $OUT/spec_chain_serving.tgz.
set -u
. bench/gpu/lib.sh
unpack_bin .gpu/one/rewind.xz
out_dir s
trap 'cp $L $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/spec_chain_serving.tgz s && rm -rf $D' EXIT
for spec in ${SERVE_MODELS:-nemotron_h:nemotron-h-8b:6 qwen3_5:qwen3.5-4b:0}; do
  init_model $R $spec
  for c in ${SERVE_CONC:-1 8}; do
    n=$(( c == 1 ? 4 : 2 * c ))
    for steps in 1 8; do
      tag=$preset-$layers${TP:+-tp$TP}-c$c-s$steps${TEMP:+-t$TEMP}
      timeout ${SERVE_S:-90} $R bench --model $m --device cuda --tp ${TP:-1} --decode replay --buffer-len 16 --max-seqs $c \
        --concurrency $c --requests $n --serving-only --prompt-len 128 --decode-tokens ${SERVE_TOKENS:-96} \
        --repeats 2 --spec ${SPEC:-oracle:0.25} --spec-window 4 --decode-steps $steps --temperature ${TEMP:-0} --json $D/$tag.json \
        > $D/$tag.md 2>$D/$tag.log
      stamp "serve $tag" $?
    done
  done
done
