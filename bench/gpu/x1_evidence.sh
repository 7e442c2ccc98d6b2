#!/usr/bin/env bash
# The single-GPU evidence of issues 10, 15 and 17 on one GPU, each part under its own timeout (PARTS picks a subset;
# the order is the order of importance; a call is at most 10 minutes, so the parts are split over calls on one warm
# machine):
#   selftest  `rewind selftest --device cuda --fixtures tests/fixtures --trained-models models/default`: every op at
#             the real shapes, every fixture and the trained models at model level in every form, verify with
#             corrupted drafts in the replay, kv-only and recurrent (per-draft snapshot) forms;
#   kernels   bench/gpu/kernels_vs_peers.sh: `rewind bench kernels` and the peers (mamba_ssm, fla) in the same call;
#   e2e       `rewind bench e2e` on random nemotron-h-8b with the measured concurrency (snapshots vs replay): about
#             440 s on an H100 (making the checkpoint 60 s, each load of it about 30 s), so a call of its own;
#   e2e-more  the same sweep on qwen3.5-4b and nemotron-3-nano-30b-a3b cut to 12 layers (E2E_MODELS2), without the
#             concurrency measure; the sweep writes its JSON after every stage, so a cut run keeps what it measured;
#   long      issue 15's long-context rows on nemotron-h-8b and qwen3.5-4b (LONG_MODELS): prefill of 8176 tokens,
#             decode at batch 64 with an 8K context (--step-prompt 8160); files named after the preset.
# Carried: .gpu/x1/rewind.xz (cargo build --release -p rewind-bin --no-default-features --features cuda; stripped,
# xz-compressed) and .whl/ (python3 bench/peers/ssm_decode.py fetch). Everything comes back as $OUT/x1.tgz.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
xz -dc .gpu/x1/rewind.xz > /tmp/rewind && chmod +x /tmp/rewind
R=/tmp/rewind
D=$OUT/r
mkdir -p $D
trap 'cp $D/run.log $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/x1.tgz r && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
date -u +%FT%TZ >> $D/device.txt
has() { case " ${PARTS:-selftest kernels e2e e2e-more long} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
W=/tmp/e2e

if has selftest; then
  timeout ${SELFTEST_S:-240} $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi

if has kernels; then
  mkdir -p $D/kernels
  OUT=$D/kernels REWIND_XZ=.gpu/x1/rewind.xz KERNELS_S=${KERNELS_S:-200} PEERS_S=${PEERS_S:-200} \
    bash bench/gpu/kernels_vs_peers.sh
  stamp kernels $?
fi

B=${E2E_BATCH:-1,64,256}
if has e2e; then
  timeout ${E2E1_S:-540} $R bench e2e --device cuda --models nemotron-h-8b --batch $B --requests 128 --work-dir $W \
    --json $D/e2e-n8b.json --markdown $D/e2e-n8b.md > $D/e2e-n8b.log 2>&1
  stamp "e2e nemotron-h-8b" $?
fi
if has e2e-more; then
  timeout ${E2E2_S:-540} $R bench e2e --device cuda --models ${E2E_MODELS2:-qwen3.5-4b,nemotron-3-nano-30b-a3b} \
    --batch $B --requests 128 --work-dir $W --no-concurrency --json $D/e2e-more.json --markdown $D/e2e-more.md \
    > $D/e2e-more.log 2>&1
  stamp "e2e more models" $?
fi

if has long; then
  # LONG_MODELS: presets (init-model arch:preset) whose long-context rows run, 8B first.
  for am in ${LONG_MODELS:-nemotron_h:nemotron-h-8b qwen3_5:qwen3.5-4b}; do
    arch=${am%%:*} preset=${am#*:}
    [ -f $W/$preset/config.json ] || $R init-model --arch $arch --preset $preset --seed 7 --out $W/$preset > /dev/null 2>>$L
    timeout ${LONG_S:-150} $R bench --device cuda --model $W/$preset --batch 1 --prompt-len 8176 \
      --decode-tokens 16 --repeats 3 --json $D/$preset-p8176.json > $D/$preset-p8176.md 2>>$L
    stamp "$preset prefill 8176" $?
    timeout ${LONG_S:-150} $R bench --device cuda --model $W/$preset --batch 64 --step-prompt 8160 \
      --prompt-len 1024 --decode-tokens 16 --repeats 3 --json $D/$preset-b64-ctx8k.json > $D/$preset-b64-ctx8k.md 2>>$L
    stamp "$preset batch 64 at 8K context" $?
  done
fi
