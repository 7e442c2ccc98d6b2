#!/usr/bin/env bash
# Tensor-core prefill scans (Mamba-2, GDN) and MoE grouped GEMM on the device (issue 15, items 1 and 3), in two parts so each
# fits one device call:
#   PART=kernels  the whole self-test (every parity case, the new tensor-core ones included, and the model-level
#                 checks), kernels/examples/cuda_timing's `scans` and `moe` sections (SIMT vs tensor cores side by
#                 side) and the peers on the same shapes (bench/peers/prefill.py: mamba_ssm, fla, torch._grouped_mm);
#   PART=e2e      prefill time to first token before / after: `rewind bench` on a random Nemotron-H-8B (Mamba-2 +
#                 dense MLP), a random Nemotron-3-Nano-30B-A3B cut to 12 layers (Mamba-2 + MoE + attention) and a
#                 random Qwen3.5-4B (Gated DeltaNet + attention; MODELS picks a subset),
#                 one 1024-token prompt, the previous build (.gpu/old/rewind.xz) and this one back to back.
# Binaries built on the host and carried in .gpu/ (rewind xz-compressed); peers in .whl/ (see bench/peers/prefill.py).
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
xz -dc .gpu/rewind.xz > /tmp/rewind && chmod +x /tmp/rewind
R=/tmp/rewind
L=$OUT/run.log
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/device.txt
date -u +%FT%TZ >> $OUT/device.txt
case ${PART:-kernels} in
kernels)
  timeout ${SELFTEST_S:-240} $R selftest --device cuda --trained-models models/default --json $OUT/selftest.json \
    > $OUT/selftest.log 2>&1
  echo "selftest rc $? at $(( $(date +%s) - t0 )) s" >> $L
  timeout 120 .gpu/cuda_timing scans > $OUT/timing-scans.log 2>&1
  echo "timing scans rc $? at $(( $(date +%s) - t0 )) s" >> $L
  timeout 150 .gpu/cuda_timing moe > $OUT/timing-moe.log 2>&1
  echo "timing moe rc $? at $(( $(date +%s) - t0 )) s" >> $L
  timeout 200 python3 bench/peers/prefill.py --json $OUT/peers.json > $OUT/peers.log 2>&1
  echo "peers rc $? at $(( $(date +%s) - t0 )) s" >> $L
  ;;
e2e)
  xz -dc .gpu/old/rewind.xz > /tmp/rewind-old && chmod +x /tmp/rewind-old
  for m in ${MODELS:-n8b nano12 q4b}; do
    case $m in
      n8b) init="--arch nemotron_h --preset nemotron-h-8b" ;;
      nano12) init="--arch nemotron_h --preset nemotron-3-nano-30b-a3b --layers 12" ;;
      q4b) init="--arch qwen3_5 --preset qwen3.5-4b" ;;
    esac
    [ -f /tmp/$m/config.json ] || $R init-model $init --out /tmp/$m > /dev/null 2>>$L
  done
  echo "models at $(( $(date +%s) - t0 )) s" >> $L
  B="bench --device cuda --batch 1 --prompt-len 1024 --decode-tokens 16 --repeats 5"
  for m in ${MODELS:-n8b nano12 q4b}; do
    for v in old new; do
      bin=$R; [ $v = old ] && bin=/tmp/rewind-old
      timeout 200 $bin $B --model /tmp/$m --json $OUT/$m-$v.json > $OUT/$m-$v.md 2>>$L
      echo "$m $v rc $? at $(( $(date +%s) - t0 )) s" >> $L
    done
  done
  ;;
esac
