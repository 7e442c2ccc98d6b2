#!/usr/bin/env bash
# Proves that `rewind init-model` writes checkpoints transformers loads, and that `rewind logits` matches transformers
# on them (prefill and decode), for every family. Usage: scripts/reference/check_init_models.sh [REWIND_BIN] [PYTHON]
set -euo pipefail
rewind=${1:-target/release/rewind}
python=${2:-python3}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tokens=3,17,42,7,99,5,250,11,64,8,301,12
status=0
for arch in nemotron_h qwen3_next qwen3_5 qwen3_5_moe; do
  "$rewind" init-model --arch "$arch" --preset tiny --out "$work/$arch" --seed 5 2>/dev/null
  "$rewind" logits --model "$work/$arch" --tokens "$tokens" --prefill 8 --out "$work/$arch.rewind.json"
  echo "== $arch"
  "$python" "$here/check_checkpoint.py" "$work/$arch" --tokens "$tokens" --prefill 8 \
    --out "$work/$arch.ref.json" --compare "$work/$arch.rewind.json" --tol 1e-4 || status=1
  # The tokenizer must load in transformers too and agree with rewind's ids.
  "$python" - "$work/$arch" <<'PY' || status=1
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok("Hello, rewind! 123 — ünïcode")["input_ids"]
assert tok.decode(ids, skip_special_tokens=True) == "Hello, rewind! 123 — ünïcode", tok.decode(ids)
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(f"tokenizer ok: {len(ids)} ids, chat template renders {chat!r}")
PY
done
exit $status
