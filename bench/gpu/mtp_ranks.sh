#!/usr/bin/env bash
# MTP drafting on the GPU ranks (issue 41): serving through the coordinator with the trained default models'
# MTP heads, `rewind bench --serving-only --spec mtp` (plain and speculative passes side by side in one engine,
# medians of --repeats) at concurrency 1 / 16 / 64 (CONCS), T = WINDOW (default 4), bf16. Carries the build of
# bench/gpu/build_ab.sh in .gpu/sel (VARIANT, default main). Logs and JSON under $OUT/mtp.
#
#   VARIANT=main bash bench/gpu/mtp_ranks.sh        (carry .gpu/sel)
set -uo pipefail
. bench/gpu/lib.sh
use_kcache .gpu/sel/kcache.tar.xz
out_dir mtp
mkdir -p /tmp/bins && xz -dc .gpu/sel/bins.tar.xz | tar -C /tmp/bins -xf -
R=/tmp/bins/${VARIANT:-main}
for arch in ${ARCHS:-qwen3_5 nemotron_h}; do
  for c in ${CONCS:-1 16 64}; do
    n=$((c * 2)); [ "$c" = 1 ] && n=8
    tag=$arch-c$c
    timeout 300 $R bench --device cuda --model models/default/$arch --serving-only --concurrency $c --requests $n \
      --prompt-len ${PROMPT:-128} --decode-tokens ${TOKENS:-128} --repeats 3 --spec mtp --spec-window ${WINDOW:-4} \
      --json $D/$tag.json > $D/$tag.md 2> $D/$tag.err
    stamp "$tag" $?
    { echo "== $tag"; grep -E "side by side|accepted|tok/s" $D/$tag.md; grep -E "^error|panick" $D/$tag.err; } >> $L
  done
done
cat $L
