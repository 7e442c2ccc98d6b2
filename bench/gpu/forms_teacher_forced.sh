#!/usr/bin/env bash
# Teacher-forced form checks on the GPU with f32 activations (--dtype f32): every form and the verify path against
# recurrent decoding, 128 prompt tokens then 128 decoded / verified.
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:$LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0
R=${REWIND:-.gpu/rewind}
M=/tmp/models; mkdir -p $M
LOG=$OUT/forms32.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $LOG
git rev-parse HEAD >> $LOG 2>/dev/null
for spec in "nemotron_h nemotron-h-8b 8" "qwen3_5 qwen3.5-4b 4"; do
  set -- $spec
  $R init-model --arch $1 --preset $2 --layers $3 --dtype f32 --out $M/$2 --seed 5 > /dev/null 2>>$LOG || echo "init failed $2" >> $LOG
done
python3 -c "import random; random.seed(1); print(','.join(str(random.randrange(1000, 100000)) for _ in range(256)))" > /tmp/toks.txt
T=$(cat /tmp/toks.txt)
for m in nemotron-h-8b qwen3.5-4b; do
  for dt in f32 bf16; do
    for flags in "--decode replay --buffer-len 16" "--decode kv-only" "--decode replay --buffer-len 16 --verify-window 4 --verify-reject 0.25" "--decode replay --buffer-len 16 --verify-window 4 --verify-reject 0" "--decode auto --verify-window 4 --verify-reject 0.25"; do
      echo "== $m dtype=$dt $flags" >> $LOG
      timeout 200 $R logits --model $M/$m --device cuda --dtype $dt --tokens $T --prefill 128 --out /tmp/c.json $flags --reference-form recurrent >> $LOG 2>&1
      cat /tmp/c.json >> $LOG; echo >> $LOG
    done
  done
done
