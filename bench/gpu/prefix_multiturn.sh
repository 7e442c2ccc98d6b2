#!/usr/bin/env bash
# Automatic prefix caching on a multi-turn chat workload (issue 43's evidence): `rewind bench multi-turn` on a random
# model of a real shape (MODEL = arch:preset:layers, 0 = the preset's depth; default nemotron_h:nemotron-h-8b:0),
# the prefix cache off and then on in fresh engines: 32 conversations of 8–12 turns, a shared 500-token system prompt,
# a 1000-token prefix per conversation, user turns of 120–160 tokens and replies of 80–120, 16 clients. Reported:
# prefilled / prompt tokens, TTFT p50 / p99 and per turn, whether the replies match. DTYPE (default bf16) picks the
# activations; in f32 the replies must match exactly.
#
#   VARIANTS="lp" bash bench/gpu/prefix_multiturn.sh        (carry .gpu/sel)
set -uo pipefail
. bench/gpu/lib.sh
out_dir prefix-multiturn
[ -d /tmp/bins ] || { mkdir -p /tmp/bins && xz -dc .gpu/sel/bins.tar.xz | tar -C /tmp/bins -xf -; }
use_kcache .gpu/sel/kcache.tar.xz
set -- ${VARIANTS:?names of the carried builds}
R=/tmp/bins/$1
init_model $R ${MODEL:-nemotron_h:nemotron-h-8b:0}
for dtype in ${DTYPES:-bf16}; do
  # shellcheck disable=SC2086
  timeout ${BENCH_S:-500} $R bench multi-turn --model $m --device cuda --dtype $dtype ${BENCH_ARGS:-} \
    --json $D/multiturn-$preset-$layers-$dtype.json > $D/multiturn-$preset-$layers-$dtype.md 2>> $L
  stamp "multi-turn $preset $layers $dtype" $?
  cat $D/multiturn-$preset-$layers-$dtype.md >> $L
done
cat $L
