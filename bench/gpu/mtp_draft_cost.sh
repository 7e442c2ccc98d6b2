#!/usr/bin/env bash
# What MTP drafting on the GPU ranks costs (issue 41): `rewind bench --verify-window 4 --mtp-draft` on random
# qwen3.5-4b and nemotron-h-8b checkpoints with an MTP layer (`init-model --mtp`, the family's published layout),
# bf16, batch 1 / 64 / 256 (BATCHES). Each batch times the plain verify steps of T = 4 drafts at every kept count,
# then verify steps that draft their next window with the MTP layer (the catch-up over the kept rows and T draft
# steps, CUDA events around that work on the device, CUDA graphs on): the `MTP draft` rows give its device time as
# a fraction of the verify step (target <= 0.15). Carries the build of bench/gpu/build_ab.sh in .gpu/sel (VARIANT,
# default main), as bench/gpu/mtp_ranks.sh does. Logs and JSON under $OUT/mtp-draft; about 5 minutes on an H200.
#
#   OUTDIR=.gpu/sel bash bench/gpu/build_ab.sh main=HEAD; then on a device:
#   VARIANT=main bash bench/gpu/mtp_draft_cost.sh        (carry .gpu/sel)
set -uo pipefail
. bench/gpu/lib.sh
use_kcache .gpu/sel/kcache.tar.xz
out_dir mtp-draft
mkdir -p /tmp/bins && xz -dc .gpu/sel/bins.tar.xz | tar -C /tmp/bins -xf -
R=/tmp/bins/${VARIANT:-main}
for spec in ${MODELS:-qwen3_5:qwen3.5-4b nemotron_h:nemotron-h-8b}; do
  IFS=: read -r arch preset <<< "$spec"
  m=/tmp/m-$preset-mtp
  [ -f $m/config.json ] || timeout 150 $R init-model --arch $arch --preset $preset --mtp --out $m --seed 7 \
    > /dev/null 2>> $L
  stamp "init $preset" $?
  timeout 200 $R bench --device cuda --model $m --batch ${BATCHES:-1,64,256} --max-seqs 256 --prompt-len 64 \
    --step-prompt ${PROMPT:-256} --decode-tokens ${TOKENS:-20} --repeats ${REPEATS:-3} --verify-window ${WINDOW:-4} \
    --buffer-len 16 --mtp-draft --json $D/$preset.json > $D/$preset.md 2> $D/$preset.err
  stamp "bench $preset" $?
  { echo "== $preset"; grep -E "MTP draft|verify T|CUDA graphs" $D/$preset.md; grep -E "^error|panick" $D/$preset.err; } >> $L
done
cat $L
