#!/usr/bin/env bash
# Trains an MTP layer for each default model (models/default/<arch>, frozen) on the device machine, one after the
# other, and packs what changed into $OUT.
#
#   bash scripts/train/run_gpu_mtp.sh            (from the repo root; total wall ~7 minutes on one H200)
#
# Env knobs: MINUTES_NEMOTRON_H, MINUTES_QWEN3_5 (default 2.5 each): training budget per model (MINUTES, if set,
#            overrides both); ARCHS (default "nemotron_h qwen3_5"); OUT (default ./train_out); WORK (scratch dir,
#            default /tmp/train_mtp_work); EXTRA (extra args for train_mtp.py).
# $OUT gets only (at most 3 files, each well under 15 MiB):
#   $OUT/run.log                 everything printed (env, both training logs, summaries)
#   $OUT/<arch>_mtp.tar.xz       <arch>/{mtp.safetensors, config.json, mtp_summary.json, mtp_loss.csv, train_mtp.log}
# The checkpoint's own files do not change and are not sent back. Install on the build machine with
#   python3 scripts/train/install_mtp.py --from <where the files came back>
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/train_out}"
WORK="${WORK:-/tmp/train_mtp_work}"
ARCHS="${ARCHS:-nemotron_h qwen3_5}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XZ_OPT="${XZ_OPT:--T0}"

minutes_for() {
  if [ -n "${MINUTES:-}" ]; then echo "$MINUTES"; return; fi
  case "$1" in
    nemotron_h) echo "${MINUTES_NEMOTRON_H:-2.5}" ;;
    qwen3_5) echo "${MINUTES_QWEN3_5:-2.5}" ;;
    *) echo 2.5 ;;
  esac
}

main() {
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python3 -c "import torch, transformers, tokenizers, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'safetensors', safetensors.__version__)"
    git rev-parse HEAD 2>/dev/null
  } 2>&1

  status=0
  for arch in $ARCHS; do
    rm -rf "${WORK:?}/$arch" "$WORK/$arch.ckpt"; mkdir -p "$WORK/$arch"
    mins=$(minutes_for "$arch")
    echo "=== $arch: training its MTP layer for $mins min ==="
    python3 scripts/train/train_mtp.py --ckpt "models/default/$arch" --out "$WORK/$arch.ckpt" --minutes "$mins" \
      ${EXTRA:-} 2>&1 | grep --line-buffered -v -E "Writing model shards|Loading weights" | tee "$WORK/$arch/train_mtp.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "!!! $arch failed with exit code $rc"; status=1; fi
    # Only what differs from models/default/<arch> (and the logs) comes back.
    for f in mtp.safetensors config.json mtp_summary.json mtp_loss.csv; do
      [ -f "$WORK/$arch.ckpt/$f" ] && cp "$WORK/$arch.ckpt/$f" "$WORK/$arch/"
    done
    tar -cJf "$OUT/${arch}_mtp.tar.xz" -C "$WORK" "$arch"
    ls -l "$OUT/${arch}_mtp.tar.xz"
  done
  for arch in $ARCHS; do
    [ -f "$WORK/$arch/mtp_summary.json" ] && python3 - "$WORK/$arch/mtp_summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
h = s["heldout_bf16"]
print(f"{s['model_type']:12s} MTP {s['mtp_parameters'] / 1e6:.2f}M params  {s['steps_run']} steps in {s['train_seconds']}s"
      f"  saved step {s['saved_step']}  held-out (bf16): top-1 {h['top1']}  agrees with target {h['agree']}"
      f"  expected accepted at T={s['args']['steps']}: {h['expected_accepted']}")
PY
  done
  echo "files in $OUT:"; ls -l "$OUT"
  return $status
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
