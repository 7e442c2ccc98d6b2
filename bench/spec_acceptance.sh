#!/usr/bin/env bash
# Accepted drafts per verify step of the n-gram and MTP drafters on the two default models (CPU, greedy): for each
# model, drafter and window T (2, 4, 6), `rewind generate --temperature 0 --ignore-eos --max-tokens 64 --json` from
# 16 held-out prompts (the first 400 characters, cut at a space, of 16 chapters spread over
# scripts/train/data/valid.jsonl.xz); the counters of all prompts are summed. Prints one JSON line per run to
# $JSONL (if set) and a markdown table: accepted per verify step, acceptance rate (accepted / drafted), tokens per
# verify step (1 + accepted per verify step) and tokens per step over all steps after the prompt's (verifies and
# plain decodes, when a drafter had nothing to propose).
#
#   bench/spec_acceptance.sh [REWIND_BINARY]
#
# Env: NEMOTRON_H, QWEN3_5 (checkpoint dirs; default models/default/<arch>, which --spec mtp needs with mtp.* tensors),
#      WINDOWS (default "2 4 6"), SPECS (default "ngram mtp"), PROMPTS (default 16), MAX_TOKENS (default 64), JSONL.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-target/release/rewind}
WINDOWS=${WINDOWS:-2 4 6}
SPECS=${SPECS:-ngram mtp}
PROMPTS=${PROMPTS:-16}
MAX_TOKENS=${MAX_TOKENS:-64}
declare -A MODEL=([nemotron_h]=${NEMOTRON_H:-models/default/nemotron_h} [qwen3_5]=${QWEN3_5:-models/default/qwen3_5})
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
python3 - "$DIR" "$PROMPTS" <<'PY'
import json, lzma, sys
out, n = sys.argv[1], int(sys.argv[2])
docs = [json.loads(l)["text"] for l in lzma.open("scripts/train/data/valid.jsonl.xz", "rt", encoding="utf-8") if l.strip()]
step = max(1, len(docs) // n)
for i, d in enumerate(docs[::step][:n]):
    open(f"{out}/p{i:02d}.txt", "w").write(d[:400].rsplit(" ", 1)[0] + "\n")
PY
for arch in nemotron_h qwen3_5; do
  for spec in $SPECS; do
    for t in $WINDOWS; do
      echo "== $arch --spec $spec T=$t (${MODEL[$arch]})" >&2
      for p in "$DIR"/p*.txt; do
        "$R" generate --model "${MODEL[$arch]}" --prompt-file "$p" --temperature 0 --ignore-eos \
          --max-tokens "$MAX_TOKENS" --spec "$spec" --spec-window "$t" --json 2>"$DIR/err" >"$DIR/out" \
          || { cat "$DIR/err" >&2; exit 1; }
        python3 -c 'import json, sys; st = json.load(open(sys.argv[1]))["stats"]
print(json.dumps({"model": sys.argv[2], "spec": sys.argv[3], "window": int(sys.argv[4]), "prompt": sys.argv[5],
                  "generated": st["generated_tokens"], **st["spec"]}))' \
          "$DIR/out" "$arch" "$spec" "$t" "$(basename "$p" .txt)" >>"$DIR/runs.jsonl"
      done
    done
  done
done
[ -n "${JSONL:-}" ] && cp "$DIR/runs.jsonl" "$JSONL"
python3 - "$DIR/runs.jsonl" "$PROMPTS" "$MAX_TOKENS" <<'PY'
import json, sys
from collections import defaultdict
tot = defaultdict(lambda: [0, 0, 0, 0])
for line in open(sys.argv[1]):
    r = json.loads(line)
    t = tot[(r["model"], r["spec"], r["window"])]
    t[0] += r["drafted"]; t[1] += r["accepted"]; t[2] += r["steps"]
    t[3] += r["generated"] - 1  # the first token comes from the prompt's step
print(f"Greedy, {sys.argv[2]} held-out prompts × {sys.argv[3]} tokens, counters summed over prompts. A step that "
      "has no drafts (the n-gram drafter found no match) decodes one token and is not a verify step; the last "
      "column counts every step after the prompt's.\n")
print("| model | drafter | T | verify steps | drafted | accepted | accepted / verify step | acceptance "
      "| tokens / verify step | tokens / step |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for (m, s, w), (d, a, n, g) in tot.items():
    steps = g - a  # every step (verify or plain decode) yields one token beyond the drafts it accepted
    print(f"| {m} | {s} | {w} | {n} | {d} | {a} | {a / max(n, 1):.2f} | {a / max(d, 1):.1%} | {1 + a / max(n, 1):.2f} "
          f"| {g / max(steps, 1):.2f} |")
PY
