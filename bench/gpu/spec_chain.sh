#!/usr/bin/env bash
# Chained verify steps on one GPU (issue 10 item 4, the device-side commit; `StepPlan::spec_chain`,
# engine/src/gpu/spec_chain.rs): greedy verifies judged (`spec_accept`), committed and drafted (`chain_advance`,
# `chain_draft`) on the device, several steps a plan. PARTS picks a subset, in order:
#   smoke     the kernels' parity cases (`--only chain`, `--only spec_accept`) and one short chained verify bench;
#   selftest  the whole `rewind selftest --device cuda --fixtures tests/fixtures --trained-models models/default`:
#             beside every earlier check, the model-level `spec_chain` rows (every fixture and trained model, replay,
#             kv-only and auto, bf16 and f32, n-gram and table drafters, chains against single verify steps);
#   bench     `rewind bench --verify-window T --decode-steps N` on BENCH_MODELS (arch:preset:layers, 0 = the preset's
#             depth): every verify row at every kept count in single steps and in chains of N, side by side.
# Carried: .gpu/one/rewind.xz (stripped release build, --no-default-features --features cuda) and
# .gpu/one/kcache.tar.xz (`rewind compile-kernels --arch sm_90 --fill-cache`). Everything comes back as
# $OUT/spec_chain.tgz.
set -u
. bench/gpu/lib.sh
unpack_bin .gpu/one/rewind.xz
out_dir r
trap 'cp $L $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/spec_chain.tgz r && rm -rf $D' EXIT
git rev-parse HEAD >> $D/device.txt 2>/dev/null
has() { case " ${PARTS:-smoke selftest bench} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has smoke; then
  for op in chain spec_accept; do
    timeout 120 $R selftest --device cuda --only $op --no-model --json $D/smoke-$op.json > $D/smoke-$op.log 2>&1
    stamp "smoke $op" $?
  done
  $R init-model --arch nemotron_h --preset tiny --out /tmp/tiny --seed 3 > /dev/null 2>>$L
  timeout 120 $R bench --model /tmp/tiny --device cuda --decode replay --batch 1,4 --prompt-len 32 --step-prompt 32 \
    --decode-tokens 32 --repeats 2 --verify-window 3 --decode-steps 4 --json $D/smoke-bench.json \
    > $D/smoke-bench.md 2>$D/smoke-bench.log
  stamp "smoke bench" $?
fi

if has selftest; then
  timeout ${SELFTEST_S:-300} $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi

if has bench; then
  for spec in ${BENCH_MODELS:-nemotron_h:nemotron-h-8b:0 qwen3_5:qwen3.5-4b:0}; do
    init_model $R $spec
    for form in ${BENCH_FORMS:-replay}; do
      timeout ${BENCH_S:-200} $R bench --model $m --device cuda --decode $form --buffer-len 16 \
        --batch ${BENCH_BATCH:-1,64} --max-seqs 64 --prompt-len ${PROMPT:-512} --step-prompt ${PROMPT:-512} \
        --decode-tokens ${DECODE_TOKENS:-40} --repeats ${REPEATS:-2} --verify-window ${WINDOW:-4} \
        --decode-steps ${CHAIN:-8} --json $D/bench-$preset-$layers-$form.json \
        > $D/bench-$preset-$layers-$form.md 2>$D/bench-$preset-$layers-$form.log
      stamp "bench $preset $layers $form" $?
    done
  done
fi
