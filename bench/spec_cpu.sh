#!/usr/bin/env bash
# Speculative decoding on the CPU: for each drafter, the same greedy requests run plain and speculative side by side
# in one engine (`rewind bench --spec ... --serving-only`, medians of --repeats passes). Every drafter runs on one
# random `small` nemotron_h target with a random MTP layer (Nemotron-3 layout); MTP also on a random `small` qwen3_5
# (Qwen layout); and the n-gram drafter on the trained default model (models/default/nemotron_h), whose text repeats
# itself.
# Writes bench/results/spec-cpu-DATE.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REWIND:-target/release/rewind}
DATE=$(date +%F)
OUT=bench/results/spec-cpu-$DATE
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$R" init-model --arch nemotron_h --preset small --mtp --seed 1 --out "$TMP/target" >/dev/null
"$R" init-model --arch nemotron_h --preset small --layers 2 --seed 1 --out "$TMP/draft" >/dev/null
"$R" init-model --arch qwen3_5 --preset small --mtp --seed 1 --out "$TMP/qwen-mtp" >/dev/null
COMMON=(--serving-only --concurrency 1 --requests 4 --prompt-len 64 --decode-tokens 64 --repeats 3)
run() { # name, model args..., spec args...
  local name=$1; shift
  echo "== $name" >&2
  "$R" bench "${COMMON[@]}" "$@" --json "$TMP/$name.json" >"$TMP/$name.md"
}
T=(--model "$TMP/target")
run ngram "${T[@]}" --spec ngram
run oracle-0.25 "${T[@]}" --spec oracle:0.25
run oracle-0 "${T[@]}" --spec oracle:0
run draft-2-layer "${T[@]}" --spec "draft:$TMP/draft"
run mtp-nemotron-h-small "${T[@]}" --spec mtp
run mtp-qwen3.5-small --model "$TMP/qwen-mtp" --spec mtp
run ngram-trained-default --model models/default/nemotron_h --spec ngram
python3 - "$TMP" "$OUT" <<'PY'
import json, sys, glob, os, subprocess
tmp, out = sys.argv[1], sys.argv[2]
rows, runs = [], {}
for f in sorted(glob.glob(f"{tmp}/*.json")):
    name = os.path.basename(f)[:-5]
    d = json.load(open(f))
    runs[name] = d
    s = d["serving"]["speculation"]
    r = s["report"]
    rows.append(f"| {name} | {r['drafter'].replace(tmp, '$TMP')} | {r['window']} | {r['accepted_per_step']:.2f} | "
                f"{100*r['acceptance_rate']:.1f}% | {s['plain_tok_per_s_median']:.1f} | {s['spec_tok_per_s_median']:.1f} | "
                f"{s['speedup']:.2f}x |")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
machine = f"{cpu}, {os.cpu_count()} threads"
json.dump({"command": "bench/spec_cpu.sh", "commit": commit, "machine": machine, "runs": runs},
          open(out + ".json", "w"), indent=1)
with open(out + ".md", "w") as m:
    m.write(f"# Speculative decoding on the CPU ({os.path.basename(out)[9:]})\n\n")
    m.write(f"Command: `bench/spec_cpu.sh` (commit {commit}); device: {machine}. Greedy, one request in flight, "
            "64-token prompts, 64 generated tokens, 4 requests per pass; plain and speculative passes alternate in "
            "one engine, medians of 3. Every speculative pass reproduced the plain tokens exactly (the bench fails "
            "otherwise). Target: a random `small` nemotron_h with a random MTP layer, except `mtp-qwen3.5-small` "
            "(a random `small` qwen3_5 with an MTP layer) and `ngram-trained-default` (the trained default "
            "model, models/default/nemotron_h). Random weights: the n-gram, draft-model and MTP acceptance reflects untrained models, the "
            "oracle's is set by P.\n\n")
    m.write("| run | drafter | T | accepted / step | acceptance | plain tok/s | spec tok/s | speed-up |\n|---|---|---|---|---|---|---|---|\n")
    m.write("\n".join(rows) + "\n")
print(open(out + ".md").read())
PY
