#!/usr/bin/env bash
# Serving side by side (plain vs --spec oracle:0.25 / oracle:0, T = 4) on a random 6-layer Nemotron-H-8B.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
R=${REWIND:-./.gpu/rewind}
L=$OUT/serve.log
$R init-model --arch nemotron_h --preset nemotron-h-8b --layers 6 --out /tmp/n6b > /dev/null 2>&1
for dt in f32 bf16; do
 for c in 1 16 64; do
  for s in oracle:0.25 oracle:0; do
   n=$((c*2)); [ $c = 1 ] && n=4
   tag=$dt-c$c-${s/:/}
   $R bench --device cuda --dtype $dt --model /tmp/n6b --serving-only --concurrency $c --requests $n --prompt-len 128 --decode-tokens 64 --repeats 3 --spec $s --json $OUT/$tag.json > /tmp/o.md 2>/tmp/e; rc=$?
   echo "== $tag rc $rc" >> $L; grep -E "side by side|accepted per step" /tmp/o.md >> $L; grep -E "^note|^error" /tmp/e >> $L
  done
 done
done
cd $OUT && python3 -c "
import json,glob
out={}
for f in sorted(glob.glob('*.json')):
    out[f[:-5]]=json.load(open(f))['serving']
json.dump(out,open('all.json.txt','w'))
" && rm -f $OUT/*-c*.json
