#!/usr/bin/env bash
# Speculative decoding on the GPU: greedy --spec output vs plain (f32 and bf16; default model, 4-layer Qwen3.5-4B,
# 6-layer Nemotron-H-8B), a sampled run (whole-row judging), the MTP refusal, and serving side by side on a 6-layer
# Nemotron-H-8B (bf16) at concurrency 1 and 16.
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
R=${REWIND:-./.gpu/rewind}
L=$OUT/spec-gpu.log
$R init-model --arch qwen3_5 --preset qwen3.5-4b --layers 4 --dtype f32 --out /tmp/q4 > /dev/null 2>&1
$R init-model --arch nemotron_h --preset nemotron-h-8b --layers 6 --dtype f32 --out /tmp/n6 > /dev/null 2>&1
$R init-model --arch nemotron_h --preset nemotron-h-8b --layers 6 --out /tmp/n6b > /dev/null 2>&1
P="The quick brown fox jumps over the lazy dog and keeps running through the forest until night falls"
tok() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['stats'].get('spec'); print(d['tokens']==json.load(open(sys.argv[2]))['tokens'], s and (s['drafted'], s['accepted'], round(s['accepted_per_step'],2)))" "$@"; }
for m in default /tmp/q4 /tmp/n6; do
  M=""; [ "$m" != default ] && M="--model $m"
  for dt in f32 bf16; do
    $R generate --device cuda --dtype $dt $M --max-tokens 48 --ignore-eos --temperature 0 --json "$P" > /tmp/plain.json 2>/tmp/e; echo "$m $dt plain rc $?" >> $L; tail -2 /tmp/e >> $L
    for s in ngram oracle:0 oracle:0.25; do
      $R generate --device cuda --dtype $dt $M --max-tokens 48 --ignore-eos --temperature 0 --json --spec $s --spec-window 4 "$P" > /tmp/s.json 2>/tmp/e; rc=$?
      echo "$m $dt $s rc $rc identical,(drafted,accepted,per-step): $(tok /tmp/s.json /tmp/plain.json 2>&1)" >> $L; [ $rc != 0 ] && tail -3 /tmp/e >> $L
    done
  done
done
$R generate --device cuda --max-tokens 32 --ignore-eos --temperature 0.8 --seed 3 --json --spec oracle:0.25 "$P" > /tmp/s.json 2>/tmp/e; echo "sampled temperature 0.8 oracle:0.25 rc $? $(python3 -c "import json; d=json.load(open('/tmp/s.json')); print(len(d['tokens']), d['stats']['spec'])" 2>&1)" >> $L
$R generate --device cuda --max-tokens 8 --spec mtp "$P" > /dev/null 2>/tmp/e; echo "mtp on the default model: rc $? $(tail -1 /tmp/e)" >> $L
for c in 1 16; do
  $R bench --device cuda --model /tmp/n6b --serving-only --concurrency $c --requests $((c*2)) --prompt-len 128 --decode-tokens 64 --repeats 3 --spec oracle:0.25 --json $OUT/serve-spec-c$c.json > $OUT/serve-spec-c$c.md 2>>$L; echo "bench c$c rc $?" >> $L
done
cat $OUT/serve-spec-c*.md >> $L
