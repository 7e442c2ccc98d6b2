#!/usr/bin/env bash
# Trains both default-model candidates on the device machine, one after the other, and packs the results into $OUT.
#
#   bash scripts/train/run_gpu.sh            (from the repo root; total wall ~8 minutes on one H100)
#
# Env knobs: MINUTES_NEMOTRON_H (default 4.0), MINUTES_QWEN3_5 (default 3.0): training budget per model
#            (MINUTES, if set, overrides both); ARCHS (default "nemotron_h qwen3_5"); OUT (default ./train_out);
#            WORK (scratch dir, default /tmp/train_work); EXTRA (extra args for train.py).
# Work files go to $WORK/<arch>/. $OUT gets only (at most 8 files, each <= 15 MiB, as the device returns them):
#   $OUT/run.log                 everything printed (env, both training logs, summaries)
#   $OUT/<arch>.tar.xz           <arch>/{checkpoint files, loss.csv, loss.png, summary.json, samples.txt, train.log, ...}
#   or $OUT/<arch>.tar.xz.part-aa, -ab, ...  if an archive exceeds 15 MiB (cat them back together).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/train_out}"
WORK="${WORK:-/tmp/train_work}"
ARCHS="${ARCHS:-nemotron_h qwen3_5}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XZ_OPT="${XZ_OPT:--T0}"   # multithreaded xz for the archives

minutes_for() {
  if [ -n "${MINUTES:-}" ]; then echo "$MINUTES"; return; fi
  case "$1" in
    nemotron_h) echo "${MINUTES_NEMOTRON_H:-4.0}" ;;
    qwen3_5) echo "${MINUTES_QWEN3_5:-3.0}" ;;
    *) echo 3.0 ;;
  esac
}

main() {
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python3 -c "import torch, transformers, tokenizers, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'safetensors', safetensors.__version__)"
    python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
    for m in mamba_ssm causal_conv1d fla; do python3 -c "import $m; print('$m present')" 2>/dev/null || echo "$m absent (torch fallback paths)"; done
    git rev-parse HEAD 2>/dev/null
  } 2>&1

  status=0
  for arch in $ARCHS; do
    rm -rf "${WORK:?}/$arch"; mkdir -p "$WORK/$arch"
    mins=$(minutes_for "$arch")
    echo "=== $arch: training for $mins min ==="
    python3 scripts/train/train.py --arch "$arch" --minutes "$mins" --out "$WORK/$arch" ${EXTRA:-} 2>&1 \
      | grep --line-buffered -v -E "Writing model shards|Loading weights" | tee "$WORK/$arch/train.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "!!! $arch failed with exit code $rc"; status=1; fi
    if [ "$rc" -eq 0 ] && [ -x target/release/rewind ]; then
      for p in "Elizabeth" "And he said unto"; do
        timeout 60 target/release/rewind generate --model "$WORK/$arch" "$p" --max-tokens 48 2>&1 | tail -4
      done > "$WORK/$arch/rewind_generate.txt" 2>&1 || true
      cat "$WORK/$arch/rewind_generate.txt"
    fi
    # Pack (even a failed run's logs): one archive per arch, split into 15 MiB parts if it would be larger.
    tar -cJf "$WORK/$arch.tar.xz" -C "$WORK" "$arch"
    rm -f "$OUT/$arch.tar.xz" "$OUT/$arch.tar.xz.part-"*
    if [ "$(stat -c %s "$WORK/$arch.tar.xz")" -gt $((15 * 1024 * 1024)) ]; then
      split -b 15M "$WORK/$arch.tar.xz" "$OUT/$arch.tar.xz.part-"
    else
      cp "$WORK/$arch.tar.xz" "$OUT/$arch.tar.xz"
    fi
    ls -l "$OUT/$arch".tar.xz*
  done
  for arch in $ARCHS; do
    [ -f "$WORK/$arch/summary.json" ] && python3 - "$WORK/$arch/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['arch']:11s} {s['parameters']/1e6:5.2f}M params  {s['steps']} steps  {s['tokens_seen']/1e6:.0f}M tokens "
      f"({s['epochs']:.1f} epochs)  saved step {s['saved_step']}  held-out ppl {s['saved_heldout_ppl']:.2f} "
      f"(bf16 reload {s['reloaded_bf16_heldout_ppl']:.2f})")
PY
  done
  echo "files in $OUT:"; ls -l "$OUT"
  return $status
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
