#!/usr/bin/env bash
# The skinny GEMM (kernels/src/cuda/kernels/gemv.cu) on the device in one call: its timing beside cuBLAS on the
# Nemotron-H-8B / Qwen3.5-4B shapes (kernels/examples/cuda_timing.rs `gemv`), the whole self-test, then `rewind bench`
# on a random Nemotron-H-8B (52 layers, bf16) at batch 1 / 64 / 256, recurrent and replay (L = 16, verify T = 4), with
# CUDA graphs, each step beside its byte roofline. Binaries from .gpu/ (`cuda_timing` built with `cargo build
# --release -p rewind-kernels --features cuda --examples`, rewind.xz as in bench/gpu/cuda_graphs.sh). Results in $OUT.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
R=${REWIND:-./.gpu/rewind}
L=$OUT/gemv.log
t0=$(date +%s)
timeout 120 ./.gpu/cuda_timing gemv > $OUT/timing.log 2>&1
echo "timing rc $? at $(( $(date +%s) - t0 )) s" >> $L
$R selftest --device cuda --fixtures tests/fixtures --trained-models models/default --seed 7 \
  --json $OUT/selftest.json > $OUT/selftest.log 2>&1
echo "selftest rc $? at $(( $(date +%s) - t0 )) s" >> $L
if [ ! -f /tmp/n8b/config.json ]; then
  $R init-model --arch nemotron_h --preset nemotron-h-8b --out /tmp/n8b > /dev/null 2>>$L
  echo "init-model rc $? at $(( $(date +%s) - t0 )) s" >> $L
fi
B="bench --device cuda --model /tmp/n8b --buffer-len 16 --prompt-len 1024 --decode-tokens 64 --repeats 3 --batch 1,64,256 --max-seqs 256"
$R $B --decode recurrent --json $OUT/bench-recurrent.json > $OUT/bench-recurrent.md 2>>$L
echo "bench recurrent rc $? at $(( $(date +%s) - t0 )) s" >> $L
$R $B --decode replay --verify-window 4 --json $OUT/bench-replay.json > $OUT/bench-replay.md 2>>$L
echo "bench replay rc $? at $(( $(date +%s) - t0 )) s" >> $L
