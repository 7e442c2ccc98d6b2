#!/usr/bin/env bash
# Held-out perplexity of the trained default models (models/default/) against their quantized copies in each
# published layout (`rewind quantize --quant fp8-block|modelopt-fp8|nvfp4`): the CPU reference (exact dequantization,
# f32) and the GPU (weights dequantized to bf16 at load), the whole held-out split of scripts/train/data/valid.jsonl.xz
# in 512-token windows. The build is the first of VARIANTS carried in .gpu/sel (bench/gpu/build_ab.sh).
#
#   VARIANTS="lp" bash bench/gpu/quant_perplexity.sh        (carry .gpu/sel)
set -uo pipefail
. bench/gpu/lib.sh
out_dir quant-perplexity
[ -d /tmp/bins ] || { mkdir -p /tmp/bins && xz -dc .gpu/sel/bins.tar.xz | tar -C /tmp/bins -xf -; }
use_kcache .gpu/sel/kcache.tar.xz
set -- ${VARIANTS:?names of the carried builds}
R=/tmp/bins/$1
python3 -c "
import lzma, json
with lzma.open('scripts/train/data/valid.jsonl.xz', 'rt') as f:
    print('\n\n'.join(json.loads(l)['text'] for l in f))
" > /tmp/heldout.txt
for m in nemotron_h qwen3_5; do
  for q in none fp8-block modelopt-fp8 nvfp4; do
    dir=models/default/$m
    if [ $q != none ]; then
      dir=/tmp/q-$m-$q
      $R quantize --model models/default/$m --out $dir --quant $q >> $L 2>&1
      stamp "quantize $m $q" $?
    fi
    for dev in "--device cpu" "--device cuda --dtype bf16"; do
      echo "== $m $q $dev" >> $D/perplexity.log
      timeout 240 $R perplexity --model $dir --file /tmp/heldout.txt --window 512 --json $dev >> $D/perplexity.log 2>&1
      stamp "perplexity $m $q $dev" $?
    done
  done
done
cat $L
grep -E "^==|perplexity\"" $D/perplexity.log | head -60
