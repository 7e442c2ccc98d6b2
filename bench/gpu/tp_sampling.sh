#!/usr/bin/env bash
# Sampled rows under tensor parallelism, drawn on the GPU ranks (engine/src/gpu/whole_rows.rs: an NCCL all-gather of
# the rows' vocabulary slices, a block copy into whole rows, the sample_rows kernel). Needs 2 GPUs. PARTS picks a
# subset, in order:
#   smoke     `rewind selftest --only copy_block --no-model` (the join's copy) and a sampled `rewind generate --tp 2`;
#   selftest  `rewind selftest --only copy_block --model-tp 1,2` with the fixtures and trained models: every
#             model-level row at TP 1 and 2, the chain rows now sampled at TP 2 too, each sampled single step's draw
#             checked against the CPU twin on the row joined on the host;
#   serving   `rewind bench --serving-only` (plain decoding through the coordinator and rank actors) on SERVE_MODEL at
#             concurrency SERVE_CONC: TP 2 greedy and sampled (TEMP), --decode-steps 1 and 8; TP 1 sampled beside it.
# Carried: .gpu/one/rewind.xz and .gpu/one/kcache.tar.xz. Everything comes back as $OUT/tp_sampling.tgz.
set -u
. bench/gpu/lib.sh
unpack_bin .gpu/one/rewind.xz
out_dir s
trap 'cp $L $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/tp_sampling.tgz s && rm -rf $D' EXIT
has() { case " ${PARTS:-smoke serving} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has smoke; then
  timeout 120 $R selftest --device cuda --only copy_block --no-model --json $D/smoke-ops.json > $D/smoke-ops.log 2>&1
  stamp "smoke ops" $?
  $R init-model --arch qwen3_5 --preset tiny --out /tmp/tiny --seed 3 > /dev/null 2>>$L
  timeout 120 $R generate --model /tmp/tiny --device cuda --tp 2 --temperature 0.8 --top-p 0.9 --seed 5 \
    --max-tokens 24 --repetition-penalty 1.1 "the" > $D/smoke-generate.log 2>&1
  stamp "smoke generate tp 2 sampled" $?
fi

if has selftest; then
  timeout ${SELFTEST_S:-420} $R selftest --device cuda --only copy_block --model-tp 1,2 --fixtures tests/fixtures \
    --trained-models models/default --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi

if has serving; then
  init_model $R ${SERVE_MODEL:-qwen3_5:qwen3.5-4b:0}
  run() { # run TP TEMP STEPS CONC
    local tag=$preset-$layers-tp$1-t$2-s$3-c$4 n=$(( $4 == 1 ? 4 : 2 * $4 ))
    timeout ${SERVE_S:-90} $R bench --model $m --device cuda --tp $1 --decode replay --buffer-len 16 --max-seqs $4 \
      --concurrency $4 --requests $n --serving-only --prompt-len 128 --decode-tokens ${SERVE_TOKENS:-96} \
      --repeats 2 --decode-steps $3 --temperature $2 --json $D/$tag.json > $D/$tag.md 2>$D/$tag.log
    stamp "serve $tag" $?
  }
  for c in ${SERVE_CONC:-1 16}; do
    for temp in 0 ${TEMP:-0.7}; do
      for steps in 1 8; do run 2 $temp $steps $c; done
    done
    run 1 ${TEMP:-0.7} 1 $c
  done
fi
