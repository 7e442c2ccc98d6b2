#!/usr/bin/env bash
# n-gram speculation on the trained default models (CPU): greedy generation of 64 tokens from 8 held-out prompts
# (the first 400 characters of 8 held-out chapters of scripts/train/data/valid.jsonl.xz), --spec ngram with window 4;
# prints one JSON line per (model, prompt) and a summary table. Usage: bench/spec_default_models.sh [REWIND_BINARY]
set -euo pipefail
R=${1:-target/release/rewind}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
python3 - "$DIR" <<'PY'
import json, lzma, sys
rows = [json.loads(l) for l in lzma.open('scripts/train/data/valid.jsonl.xz', 'rt')]
step = max(1, len(rows) // 8)
for i, r in enumerate(rows[::step][:8]):
    open(f'{sys.argv[1]}/p{i}.txt', 'w').write(r['text'][:400])
PY
for m in nemotron_h qwen3_5; do
  for p in "$DIR"/p*.txt; do
    out=$("$R" generate --default-model "$m" --prompt-file "$p" --temperature 0 --max-tokens 64 --ignore-eos \
      --spec ngram --spec-window 4 --json 2>/dev/null)
    echo "$out" | python3 -c "import json,sys; d=json.load(sys.stdin); s=d['stats']['spec']; print(json.dumps({'model': '$m', 'prompt': '$(basename "$p")', **s}))"
  done
done
