#!/usr/bin/env bash
# Issue 18's runs on a machine with 2 GPUs, in one device call, each part under its own timeout so one slow part
# cannot starve the rest (PARTS picks a subset; the order is the order of importance):
#   selftest  `rewind selftest --device cuda --fixtures tests/fixtures $SELFTEST_ARGS` (ops, the NCCL all-reduce, every fixture at
#             model level at TP 1, 2 and (with 4 GPUs) 4 in f32 and bf16: greedy decoding teacher-forced with the CPU's greedy
#             tokens in every decode form, the GPU's argmax checked at every position, and speculative verify with
#             corrupted drafts; the *_odd fixtures have n_groups not divisible by 2);
#   faults    32 concurrent requests at TP 2 (`rewind bench --concurrency 32`), fault-free and with each fault kind
#             injected into rank 1 mid-decode: the JSON holds every request's tokens, the pools before / after and
#             the recovery log (compared by the python at the end: `faults.txt`);
#   launch    rewind-launch --tp 2 with a random nemotron-3-nano-30b-a3b (cut to NANO_LAYERS layers): a gRPC
#             session (two turns and a fork), an OpenAI chat stream, SIGTERM (`launch-transcript.txt`);
#   speed     `rewind bench --device cuda --tp 1` vs `--tp 2` (and `--tp 4` with 4 GPUs) on nemotron-3-nano-30b-a3b and
#             qwen3-next-80b-a3b cut with --layers: decode step at batch 1 / 64 / 256 (SPEED_BATCH) in the recurrent,
#             replay and kv-only forms (SPEED_FORMS), prefill rate.
# The rewind binaries travel xz-compressed in .gpu/mgpu/ (built with
# `cargo build --release -p rewind-bin --no-default-features --features cuda`).
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
xz -dc .gpu/mgpu/rewind.xz > /tmp/rewind && chmod +x /tmp/rewind
[ -f .gpu/mgpu/rewind-launch.xz ] && xz -dc .gpu/mgpu/rewind-launch.xz > /tmp/rewind-launch && chmod +x /tmp/rewind-launch
R=/tmp/rewind
# At most 8 files come back from a device call: everything goes under $D and travels as one archive, made on exit.
D=$OUT/r
mkdir -p $D
trap 'cp $D/run.log $D/device.txt $OUT/ 2>/dev/null; cp $D/faults.txt $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/multi_gpu.tgz r && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
nvidia-smi topo -m >> $D/device.txt 2>&1
date -u +%FT%TZ >> $D/device.txt
# TP sizes for the speed part: 1, 2 and, on a machine with 4 GPUs, 4.
NGPU=$(nvidia-smi -L | wc -l)
TPS="1 2"; [ "$NGPU" -ge 4 ] && TPS="1 2 4"
has() { case " ${PARTS:-selftest faults launch speed} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has selftest; then
  timeout ${SELFTEST_S:-330} $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    ${SELFTEST_ARGS:-} --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi

if has faults; then
  [ -f /tmp/faultm/config.json ] || $R init-model --arch nemotron_h --preset small --out /tmp/faultm --seed 5 > /dev/null 2>>$L
  F="bench --model /tmp/faultm --device cuda --tp 2 --dtype f32 --concurrency 32 --requests 32 --serving-only \
     --prompt-len 32 --decode-tokens 32 --step-timeout 5"
  timeout ${FAULT_S:-90} $R $F --json $D/fault-none.json > $D/fault-none.md 2>>$L
  stamp "fault none" $?
  for kind in panic hang error nan; do
    timeout ${FAULT_S:-90} $R $F --inject-fault 1:$kind@20 --json $D/fault-$kind.json > $D/fault-$kind.md 2>>$L
    stamp "fault $kind" $?
  done
  python3 - > $D/faults.txt 2>&1 <<'EOF'
import json, os
out = os.environ["OUT"] + "/r"
base = json.load(open(f"{out}/fault-none.json"))["serving"]
print("kind\trequests\tsame tokens as fault-free\tfaults\trecoveries (restart ms)\tpools before -> after")
for kind in ["none", "panic", "hang", "error", "nan"]:
    try:
        r = json.load(open(f"{out}/fault-{kind}.json"))["serving"]
    except Exception as e:
        print(f"{kind}\tmissing ({e})"); continue
    same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
    rec = r["engine"]["recoveries"]
    p = r["pools"]
    print(f"{kind}\t{len(r['tokens'])}\t{same}/{len(base['tokens'])}\t{r['engine']['faults']}\t{json.dumps(rec)}\t"
          f"{json.dumps(p['before'])} -> {json.dumps(p['after'])}")
EOF
fi

if has launch; then
  REWIND=$R REWIND_LAUNCH=/tmp/rewind-launch M=/tmp/nano LAUNCH_ARGS="--tp 2" T=$D/launch-transcript.txt LOG=$D/launch.log \
    INIT="--arch nemotron_h --preset nemotron-3-nano-30b-a3b --layers ${NANO_LAYERS:-6}" bash bench/gpu/launch_transcript.sh
  stamp launch $?
fi

if has speed; then
  [ -f /tmp/nano/config.json ] || $R init-model --arch nemotron_h --preset nemotron-3-nano-30b-a3b \
    --layers ${NANO_LAYERS:-6} --out /tmp/nano --seed 3 > /dev/null 2>>$L
  [ -f /tmp/qnext/config.json ] || [ "${SPEED_MODELS:-qnext}" = nano ] || $R init-model --arch qwen3_next --preset qwen3-next-80b-a3b \
    --layers ${QNEXT_LAYERS:-4} --out /tmp/qnext --seed 3 > /dev/null 2>>$L
  for m in ${SPEED_MODELS:-nano qnext}; do
    for tp in ${SPEED_TPS:-$TPS}; do
      for form in ${SPEED_FORMS:-recurrent replay kv-only}; do
        timeout ${SPEED_S:-60} $R bench --model /tmp/$m --device cuda --tp $tp --decode $form --batch ${SPEED_BATCH:-1,64,256} \
          --prompt-len 512 --decode-tokens 8 --repeats 2 --json $D/speed-$m-tp$tp-$form.json \
          > $D/speed-$m-tp$tp-$form.md 2>>$L
        stamp "speed $m tp$tp $form" $?
      done
    done
  done
fi
