#!/usr/bin/env bash
# The decode and verify steps of the final build of a session, with CUDA graphs and the skinny GEMM: a random
# Nemotron-H-8B (Mamba-2 + attention, 52 layers) replay with verify T = 4 at batch 1 / 64 / 256, and a random
# Qwen3.5-4B (Gated DeltaNet + attention) recurrent and replay at batch 1 / 64, each step beside its byte roofline.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
R=${REWIND:-./.gpu/rewind}
L=$OUT/final.log
t0=$(date +%s)
[ -f /tmp/n8b/config.json ] || $R init-model --arch nemotron_h --preset nemotron-h-8b --out /tmp/n8b > /dev/null 2>>$L
[ -f /tmp/q4b/config.json ] || $R init-model --arch qwen3_5 --preset qwen3.5-4b --out /tmp/q4b > /dev/null 2>>$L
echo "models at $(( $(date +%s) - t0 )) s" >> $L
B="bench --device cuda --buffer-len 16 --prompt-len 1024 --decode-tokens 64 --repeats 3 --max-seqs 256"
$R $B --model /tmp/n8b --batch 1,64,256 --decode replay --verify-window 4 --json $OUT/n8b-replay.json > $OUT/n8b-replay.md 2>>$L
echo "n8b replay rc $? at $(( $(date +%s) - t0 )) s" >> $L
for f in recurrent replay; do
  $R $B --model /tmp/q4b --batch 1,64 --decode $f --json $OUT/q4b-$f.json > $OUT/q4b-$f.md 2>>$L
  echo "q4b $f rc $? at $(( $(date +%s) - t0 )) s" >> $L
done
