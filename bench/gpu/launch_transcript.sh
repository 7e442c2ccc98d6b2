#!/usr/bin/env bash
# rewind-launch with a random model: a gRPC session (two turns and a fork) through `rewind client`, an HTTP chat stream
# through curl, then SIGTERM. Defaults: one GPU, a random Nemotron-H-8B. Environment: REWIND / REWIND_LAUNCH (the
# binaries), M (model directory), INIT (init-model arguments, used when M holds no model), LAUNCH_ARGS (extra
# rewind-launch flags, e.g. `--tp 2`), T (the transcript, default $OUT/launch-transcript.txt), LOG (rewind-launch's
# output, default $OUT/launch.log). bench/gpu/multi_gpu.sh runs it at TP 2.
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:$LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0
R=${REWIND:-.gpu/rewind}
L=${REWIND_LAUNCH:-.gpu/rewind-launch}
M=${M:-/tmp/nemotron-h-8b}
T=${T:-$OUT/launch-transcript.txt}
LOG=${LOG:-$OUT/launch.log}
say() { echo "$ $*" >> $T; "$@" >> $T 2>&1; echo "[exit $?]" >> $T; }
: > $T
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $T
[ -f $M/config.json ] || $R init-model ${INIT:---arch nemotron_h --preset nemotron-h-8b} --out $M --seed 3 > /dev/null \
  2> $LOG.init || { echo "init-model failed" >> $T; exit 1; }
echo "$ rewind-launch --model $M ${LAUNCH_ARGS:+$LAUNCH_ARGS }--grpc-port 50051 --http-port 8000 &" >> $T
$L --model $M ${LAUNCH_ARGS:+$LAUNCH_ARGS }--grpc-port 50051 --http-port 8000 > $LOG 2>&1 &
PID=$!
for i in $(seq 1 240); do $R client health > /dev/null 2>&1 && break; sleep 1; done
export REWIND_ADDR=http://127.0.0.1:50051
say $R client health
S=$($R client session create --max-tokens 16 --temperature 0 2>> $T)
echo "$ rewind client session create --max-tokens 16 --temperature 0" >> $T; echo "$S" >> $T
S=$(echo "$S" | grep -o 'sess-[0-9a-f]*' | head -1)
say $R client generate "The first turn of a conversation about state space models." --session $S
say $R client generate " And the second turn continues without re-prefilling the first." --session $S
F=$($R client session fork $S 2>> $T); echo "$ rewind client session fork $S" >> $T; echo "$F" >> $T
F=$(echo "$F" | grep -o 'sess-[0-9a-f]*' | grep -v "^$S$" | head -1)
say $R client generate " The fork goes its own way." --session $F
say $R client generate " While the original goes on." --session $S
say $R client session list
say $R client stats
NAME=$(curl -s http://127.0.0.1:8000/v1/models | python3 -c "import sys,json; print(json.load(sys.stdin)['data'][0]['id'])")
BODY="{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"stream\":true,\"max_tokens\":12,\"seed\":1}"
echo "$ curl -N http://127.0.0.1:8000/v1/chat/completions -d '$BODY'" >> $T
curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d "$BODY" >> $T 2>&1
echo "$ curl -s http://127.0.0.1:8000/metrics | grep -E '^rewind_(sessions|restored_tokens|prefill_tokens|generated_tokens) '" >> $T
curl -s http://127.0.0.1:8000/metrics | grep -E '^rewind_(sessions|restored_tokens|prefill_tokens|generated_tokens) ' >> $T
echo "$ kill -TERM rewind-launch" >> $T
kill -TERM $PID; wait $PID; echo "[rewind-launch exit $?]" >> $T
echo "--- rewind-launch stdout/stderr ---" >> $T; cat $LOG >> $T
