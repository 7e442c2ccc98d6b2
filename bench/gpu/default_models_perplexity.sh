#!/usr/bin/env bash
# Held-out perplexity of the trained default models (models/default/) on the CPU and the GPU (bf16 and f32
# activations): the whole held-out split of scripts/train/data/valid.jsonl.xz, 512-token windows.
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:$LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0
R=${REWIND:-.gpu/rewind}
LOG=$OUT/default-models-perplexity.log
python3 -c "
import lzma, json
with lzma.open('scripts/train/data/valid.jsonl.xz', 'rt') as f:
    print('\n\n'.join(json.loads(l)['text'] for l in f))
" > /tmp/heldout.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $LOG
wc -c /tmp/heldout.txt >> $LOG
for m in nemotron_h qwen3_5; do
  for dev in "--device cpu" "--device cuda --dtype bf16" "--device cuda --dtype f32"; do
    echo "== $m $dev" >> $LOG
    timeout 240 $R perplexity --model models/default/$m --file /tmp/heldout.txt --window 512 --json $dev >> $LOG 2>&1
  done
done
