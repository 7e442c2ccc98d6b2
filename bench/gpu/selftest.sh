#!/usr/bin/env bash
# `rewind selftest --device cuda` of each build carried in .gpu/sel (bench/gpu/build_ab.sh with OUTDIR=.gpu/sel and
# KCACHE_ARCH), on every model fixture of tests/fixtures and the trained default models; SELFTEST_ARGS adds flags
# (e.g. `--only head`, `--model-tp 1,2`). Logs and xz-compressed JSON under $OUT/selftest.
#
#   VARIANTS="lp" SELFTEST_ARGS="" bash bench/gpu/selftest.sh        (carry .gpu/sel)
set -uo pipefail
. bench/gpu/lib.sh
use_kcache .gpu/sel/kcache.tar.xz
out_dir selftest
mkdir -p /tmp/bins && xz -dc .gpu/sel/bins.tar.xz | tar -C /tmp/bins -xf -
# The fixtures folder also holds non-model data (quantized formats, tokenizers): link only the models.
mkdir -p /tmp/fixtures
for d in tests/fixtures/*/; do
  [ -f "$d/config.json" ] && ln -sfn "$PWD/$d" "/tmp/fixtures/$(basename "$d")"
done
for name in ${VARIANTS:?names of the carried builds}; do
  # shellcheck disable=SC2086
  timeout "${SELFTEST_S:-400}" /tmp/bins/$name selftest --device cuda --fixtures /tmp/fixtures \
    --trained-models models/default ${SELFTEST_ARGS:-} --json "$D/selftest-$name.json" > "$D/selftest-$name.log" 2>&1
  stamp "selftest $name" $?
  grep -E "FAIL|checks|logprobs" "$D/selftest-$name.log" | tail -40 >> "$L"
done
xz -f "$D"/*.json
cat "$L"
