#!/usr/bin/env bash
# Issue 15's closing evidence in one device call (PARTS picks a subset):
#   attention  the prefill attention tilings side by side: kernels/examples/cuda_timing's attention rows from three
#              builds carried in .gpu/attn/ (timing_A: 4 warps, Q re-read from shared memory; timing_C: 8 warps up to
#              head dim 128, Q fragments in registers, unmasked interior tiles; timing_D: C's code with 4 warps), the
#              torch SDPA peer (bench/peers/attention.py) and the attention parity cases of this build's self-test;
#   e2e        `rewind bench` before / after on random real-shape models (EMODELS: n8b = Nemotron-H-8B, q4b =
#              Qwen3.5-4B, nano12 = Nemotron-3-Nano-30B-A3B cut to 12 layers): prefill of 1024 and 8176 tokens
#              (8192 with the 16 decoded: the 8B preset's whole context) and the batch-1 (nano12: also batch-64) decode
#              step, and (this build only) decode at batch 64 with an 8K context; the build before issue 15's kernels
#              (.gpu/old/rewind.xz: commit d209f75 built with `cargo build --release -p rewind-bin
#              --no-default-features --features cuda` in a worktree, xz-compressed) and this one (.gpu/new/rewind.xz)
#              back to back, same command.
#   rows       the six kernel rows of issue 15's table with their peers in one call: `cuda_timing attention`,
#              `scans` and `moe` of one build (TIMING_XZ, default .gpu/attn/cuda_timing.xz: `cargo build --release -p
#              rewind-kernels --example cuda_timing`, stripped, xz-compressed), then bench/peers/attention.py (torch
#              SDPA) and bench/peers/prefill.py (mamba_ssm, fla, torch._grouped_mm; carry .whl/).
# Everything is written under $OUT/r and comes back as one archive (a device call returns at most 8 files).
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
D=$OUT/r
mkdir -p $D
trap 'cp $D/run.log $D/device.txt $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/peer_speed.tgz r && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
date -u +%FT%TZ >> $D/device.txt
has() { case " ${PARTS:-attention e2e} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# The binaries travel xz-compressed (what a call carries is limited): NEW_BIN / OLD_BIN name them.
for v in new old; do
  b=$( [ $v = new ] && echo ${NEW_BIN:-.gpu/new/rewind.xz} || echo ${OLD_BIN:-.gpu/old/rewind.xz} )
  [ -f $b ] && xz -dc $b > /tmp/rewind-$v && chmod +x /tmp/rewind-$v
done
for f in .gpu/attn/timing_*.xz; do [ -f $f ] && xz -dc $f > ${f%.xz} && chmod +x ${f%.xz}; done

if has attention; then
  for v in ${ATTN_VARIANTS:-A C D}; do
    timeout 90 .gpu/attn/timing_$v attention > $D/attn-$v.log 2>&1
    stamp "attention timing $v" $?
  done
  timeout 120 python3 bench/peers/attention.py --json $D/sdpa.json > $D/sdpa.log 2>&1
  stamp sdpa $?
  [ "${ATTN_SELFTEST:-1}" = 1 ] && timeout 120 /tmp/rewind-new selftest --device cuda --only attention --no-model --json $D/selftest-attention.json \
    > $D/selftest-attention.log 2>&1
  stamp "selftest attention" $?
fi

if has e2e; then
  for m in ${EMODELS:-n8b q4b nano12}; do
    case $m in
      n8b) init="--arch nemotron_h --preset nemotron-h-8b"; batch=1 ;;
      nano12) init="--arch nemotron_h --preset nemotron-3-nano-30b-a3b --layers 12"; batch=1,64 ;;
      q4b) init="--arch qwen3_5 --preset qwen3.5-4b"; batch=1 ;;
    esac
    [ -f /tmp/$m/config.json ] || /tmp/rewind-new init-model $init --out /tmp/$m > /dev/null 2>>$L
    stamp "init $m" $?
    for p in ${PROMPTS:-1024 8176}; do
      for v in old new; do
        timeout ${E2E_S:-120} /tmp/rewind-$v bench --device cuda --model /tmp/$m --batch $batch --prompt-len $p \
          --decode-tokens 16 --repeats 3 --json $D/$m-p$p-$v.json > $D/$m-p$p-$v.md 2>>$L
        stamp "$m prompt $p $v" $?
      done
    done
    # Decode at batch 64 with an 8K context (each sequence prefilled with 8160 tokens first). `--step-prompt` is
    # newer than the old build, so this row is this build's only.
    if [ $m != nano12 ]; then
      timeout ${E2E_S:-120} /tmp/rewind-new bench --device cuda --model /tmp/$m --batch 64 --step-prompt 8160 \
        --prompt-len 1024 --decode-tokens 16 --repeats 3 --json $D/$m-b64-ctx8k-new.json > $D/$m-b64-ctx8k-new.md 2>>$L
      stamp "$m batch 64 at 8K context new" $?
    fi
  done
fi

if has rows; then
  xz -dc ${TIMING_XZ:-.gpu/attn/cuda_timing.xz} > /tmp/cuda_timing && chmod +x /tmp/cuda_timing
  for sec in attention scans moe; do
    timeout 120 /tmp/cuda_timing $sec > $D/rows-$sec.log 2>&1
    stamp "cuda_timing $sec" $?
  done
  timeout 150 python3 bench/peers/attention.py --json $D/rows-sdpa.json > $D/rows-sdpa.log 2>&1
  stamp "peer sdpa" $?
  timeout 200 python3 bench/peers/prefill.py --json $D/rows-prefill-peers.json > $D/rows-prefill-peers.log 2>&1
  stamp "peers mamba_ssm fla grouped_mm" $?
fi
