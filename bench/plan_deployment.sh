#!/usr/bin/env bash
# The deployment table of docs/benchmarks.md: Nemotron-3 Super and the largest Qwen3.5 MoE on 8 × B300 and 8 × H200, at TP 8 and
# at TP 4 × 2 replicas, for 8K / 32K / 128K tokens of context, projected by `rewind plan` (roofline × the measured /
# model ratio of engine/src/plan/calibration.rs). Usage: bench/plan_deployment.sh [REWIND_BINARY]
set -euo pipefail
rewind=${1:-target/release/rewind}
first=1
for model in "nemotron_h nemotron-3-super-120b-a12b 8192,32768,131072" "qwen3_5_moe qwen3.5-397b-a17b 8192,32768,131072"; do
  set -- $model
  for gpu in b300 h200; do
    for layout in "8 1" "4 2"; do
      read -r tp replicas <<<"$layout"
      if rows=$("$rewind" plan --arch "$1" --preset "$2" --gpu "$gpu" --tp "$tp" --replicas "$replicas" \
        --context "$3" --spec-window 4 --acceptance 0.7 --forms recurrent,replay,replay+spec \
        --batch max --markdown 2>/tmp/plan_deployment.err); then
        if [ "$first" = 1 ]; then echo "$rows"; first=0; else echo "$rows" | tail -n +3; fi
      else
        # A layout that does not fit is a row saying why, not a gap.
        echo "| $2 | $((tp * replicas)) × ${gpu^^} | TP $tp × $replicas | all | $(sed 's/^error: //' /tmp/plan_deployment.err) | | |"
      fi
    done
  done
done
