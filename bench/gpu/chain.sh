#!/usr/bin/env bash
# Chained decode steps on one GPU (issue 10 item 4; `--decode-steps`, `StepPlan::chained`, engine/src/gpu/chain.rs).
# PARTS picks a subset, in order:
#   smoke     `rewind selftest --only chain_pick --no-model` and one short chained bench (a broken build stops here);
#   selftest  the whole `rewind selftest --device cuda --fixtures tests/fixtures --trained-models models/default`: the
#             chain_pick parity case and the model-level chain rows (every fixture and trained model, every form,
#             greedy and sampled, chained against single steps) beside every earlier check;
#   bench     `rewind bench --decode-steps 8`: every decode row measured in single steps and in chains of 8 in the
#             same run, on BENCH_MODELS (init-model arch:preset:layers; 0 layers = the preset's own depth) in the
#             replay and recurrent forms;
#   tp        (2 GPUs) `rewind selftest --only chain_pick --model-tp 1,2` (the merge of the ranks' picks, every
#             model-level row at TP 1 and 2), then `rewind bench --tp 1` and `--tp 2 --decode-steps 8` on TP_MODEL;
#   serving   `rewind bench --concurrency N --serving-only` through the coordinator and rank actors with
#             --decode-steps 1 and 8 (SERVE_MODELS, as BENCH_MODELS; concurrency 1 and 64; SERVE_RATIO=R gives the
#             requests lengths within ± R, so they end at different steps).
# Carried: .gpu/chain/rewind.xz (cargo build --release -p rewind-bin --no-default-features --features cuda; stripped,
# xz-compressed). Everything comes back as $OUT/chain.tgz.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
xz -dc .gpu/chain/rewind.xz > /tmp/rewind && chmod +x /tmp/rewind
R=/tmp/rewind
D=$OUT/r
mkdir -p $D
trap 'cp $D/run.log $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/chain.tgz r && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
date -u +%FT%TZ >> $D/device.txt
git rev-parse HEAD >> $D/device.txt 2>/dev/null
has() { case " ${PARTS:-smoke selftest bench serving} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has smoke; then
  timeout 120 $R selftest --device cuda --only chain_pick --no-model --json $D/smoke-ops.json > $D/smoke-ops.log 2>&1
  stamp "smoke ops" $?
  $R init-model --arch nemotron_h --preset tiny --out /tmp/tiny --seed 3 > /dev/null 2>>$L
  timeout 120 $R bench --model /tmp/tiny --device cuda --decode replay --batch 1,4 --prompt-len 32 --decode-tokens 32 \
    --repeats 2 --decode-steps 8 --json $D/smoke-bench.json > $D/smoke-bench.md 2>$D/smoke-bench.log
  stamp "smoke bench" $?
fi

if has selftest; then
  timeout ${SELFTEST_S:-400} $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi

if has bench; then
  for spec in ${BENCH_MODELS:-nemotron_h:nemotron-3-nano-30b-a3b:6 qwen3_5:qwen3.5-4b:0 nemotron_h:nemotron-h-8b:0}; do
    IFS=: read -r arch preset layers <<< "$spec"
    m=/tmp/m-$preset-$layers
    extra=""
    [ "$layers" != 0 ] && extra="--layers $layers"
    [ -f $m/config.json ] || $R init-model --arch $arch --preset $preset $extra --out $m --seed 3 > /dev/null 2>>$L
    stamp "init $preset $layers" $?
    for form in ${BENCH_FORMS:-replay recurrent}; do
      timeout ${BENCH_S:-150} $R bench --model $m --device cuda --decode $form --buffer-len 16 --batch ${BENCH_BATCH:-1,64,256} \
        --max-seqs 256 --prompt-len ${PROMPT:-512} --step-prompt ${PROMPT:-512} --decode-tokens ${DECODE_TOKENS:-64} --repeats 3 --decode-steps 8 \
        --json $D/bench-$preset-$layers-$form.json > $D/bench-$preset-$layers-$form.md 2>$D/bench-$preset-$layers-$form.log
      stamp "bench $preset $layers $form" $?
    done
  done
fi

if has serving; then
  for spec in ${SERVE_MODELS:-nemotron_h:nemotron-3-nano-30b-a3b:6 nemotron_h:nemotron-h-8b:0}; do
    IFS=: read -r arch preset layers <<< "$spec"
    m=/tmp/m-$preset-$layers
    extra=""
    [ "$layers" != 0 ] && extra="--layers $layers"
    [ -f $m/config.json ] || $R init-model --arch $arch --preset $preset $extra --out $m --seed 3 > /dev/null 2>>$L
    for c in ${SERVE_CONC:-1 64}; do
      n=$(( c == 1 ? 8 : 2 * c ))
      for steps in 1 8; do
        timeout ${SERVE_S:-90} $R bench --model $m --device cuda --decode replay --buffer-len 16 --max-seqs $c \
          --concurrency $c --requests $n --serving-only --prompt-len ${PROMPT:-512} --decode-tokens ${SERVE_TOKENS:-128} \
          ${SERVE_RATIO:+--random-range-ratio $SERVE_RATIO} \
          --decode-steps $steps --json $D/serve-$preset-$layers-c$c-s$steps.json \
          > $D/serve-$preset-$layers-c$c-s$steps.md 2>$D/serve-$preset-$layers-c$c-s$steps.log
        stamp "serve $preset $layers c$c steps $steps" $?
      done
    done
  done
fi

if has tp; then
  timeout ${TP_SELFTEST_S:-360} $R selftest --device cuda --only chain_pick --fixtures tests/fixtures \
    --trained-models models/default --model-tp 1,2 --json $D/tp-selftest.json > $D/tp-selftest.log 2>&1
  stamp "tp selftest" $?
  IFS=: read -r arch preset layers <<< "${TP_MODEL:-nemotron_h:nemotron-3-nano-30b-a3b:6}"
  m=/tmp/m-$preset-$layers
  [ -f $m/config.json ] || $R init-model --arch $arch --preset $preset --layers $layers --out $m --seed 3 > /dev/null 2>>$L
  for tp in 1 2; do
    timeout ${TP_BENCH_S:-90} $R bench --model $m --device cuda --tp $tp --decode replay --buffer-len 16 --batch 1,64 \
      --max-seqs 64 --prompt-len ${PROMPT:-512} --step-prompt ${PROMPT:-512} --decode-tokens 64 --repeats 3 \
      --decode-steps 8 --json $D/tp-bench-$preset-$layers-tp$tp.json > $D/tp-bench-$preset-$layers-tp$tp.md \
      2>$D/tp-bench-$preset-$layers-tp$tp.log
    stamp "tp bench $preset $layers tp$tp" $?
  done
fi
