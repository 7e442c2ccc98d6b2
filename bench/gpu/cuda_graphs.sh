#!/usr/bin/env bash
# CUDA graphs of decode and verify steps, before / after in one device call: the whole GPU self-test (every model-level
# form runs with graphs on, and the replay form once more eagerly), then `rewind bench` on a random Nemotron-H-8B
# (52 layers, bf16) at batch 1 / 64 / 256 with and without --no-cuda-graphs, each step with its byte-roofline fraction
# (copy bandwidth measured in the same process). PART=selftest, recurrent or replay picks one piece (a device call
# is limited to 10 minutes); results under $OUT.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
R=${REWIND:-./.gpu/rewind}
L=$OUT/graphs.log
t0=$(date +%s)
part=${PART:-all}
if [ "$part" = all ] || [ "$part" = selftest ]; then
  $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default --seed 7 \
    --json $OUT/selftest.json > $OUT/selftest.log 2>&1
  echo "selftest rc $? at $(( $(date +%s) - t0 )) s" >> $L
fi
[ "$part" = selftest ] && exit 0
# A warm machine keeps /tmp between calls: the model is made once.
if [ ! -f /tmp/n8b/config.json ]; then
  $R init-model --arch nemotron_h --preset nemotron-h-8b --out /tmp/n8b > /dev/null 2>>$L
  echo "init-model rc $? at $(( $(date +%s) - t0 )) s" >> $L
fi
B="bench --device cuda --model /tmp/n8b --buffer-len 16 --prompt-len 1024 --decode-tokens 64 --repeats 3 --batch 1,64,256 --max-seqs 256"
for f in recurrent replay; do
  if [ "$part" = all ] || [ "$part" = $f ]; then
    extra=""
    [ $f = replay ] && extra="--verify-window 4"
    for g in graphs eager; do
      flag=""
      [ $g = eager ] && flag="--no-cuda-graphs"
      $R $B --decode $f $extra $flag --json $OUT/bench-$f-$g.json > $OUT/bench-$f-$g.md 2>>$L
      echo "bench $f $g rc $? at $(( $(date +%s) - t0 )) s" >> $L
    done
  fi
done
