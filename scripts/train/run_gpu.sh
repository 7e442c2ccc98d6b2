#!/usr/bin/env bash
# Trains both default-model candidates on the device machine, one after the other, and writes everything to $OUT.
#
#   bash scripts/train/run_gpu.sh            (from the repo root; total wall ~8 minutes on one H100)
#
# Env knobs: MINUTES (training budget per model, default 3.25), ARCHS (default "nemotron_h qwen3_5"),
#            OUT (default ./train_out), EXTRA (extra args for train.py).
# Per model: $OUT/<arch>/{config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
#            tokenizer_config.json, loss.csv, loss.png (if matplotlib), samples.txt, summary.json, train.log}
# Plus $OUT/env.txt and, when a rewind binary was carried along (target/release/rewind), $OUT/<arch>/rewind_generate.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/train_out}"
MINUTES="${MINUTES:-3.25}"
ARCHS="${ARCHS:-nemotron_h qwen3_5}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, transformers, tokenizers, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'safetensors', safetensors.__version__)"
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
  for m in mamba_ssm causal_conv1d fla; do python3 -c "import $m; print('$m present')" 2>/dev/null || echo "$m absent (torch fallback paths)"; done
  git rev-parse HEAD 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
for arch in $ARCHS; do
  mkdir -p "$OUT/$arch"
  echo "=== $arch: training for $MINUTES min ==="
  python3 scripts/train/train.py --arch "$arch" --minutes "$MINUTES" --out "$OUT/$arch" ${EXTRA:-} 2>&1 \
    | grep --line-buffered -v -E "Writing model shards|Loading weights" | tee "$OUT/$arch/train.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "!!! $arch failed with exit code $rc"; status=1; continue; fi
  if [ -x target/release/rewind ]; then
    for p in "Elizabeth" "And he said unto"; do
      timeout 60 target/release/rewind generate --model "$OUT/$arch" "$p" --max-tokens 48 2>&1 | tail -4
    done > "$OUT/$arch/rewind_generate.txt" 2>&1 || true
    cat "$OUT/$arch/rewind_generate.txt"
  fi
done
for arch in $ARCHS; do
  [ -f "$OUT/$arch/summary.json" ] && python3 - "$OUT/$arch/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['arch']:11s} {s['parameters']/1e6:5.1f}M params  {s['steps']} steps  {s['tokens_seen']/1e6:.0f}M tokens "
      f"({s['epochs']:.1f} epochs)  held-out ppl {s['saved_heldout_ppl']:.2f} (bf16 reload {s['reloaded_bf16_heldout_ppl']:.2f})")
PY
done
exit $status
