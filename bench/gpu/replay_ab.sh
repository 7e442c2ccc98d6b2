#!/usr/bin/env bash
# The replay kernels of several builds side by side on one GPU in one call: the replay parity cases of every build
# but the first, `rewind bench kernels` of every build alternated (A B A B, so drift shows), the whole self-test of
# the last build, and with E2E=1 every build end to end on one random model.
#
# VARIANTS (default "before after") names the builds in order, e.g. VARIANTS="before fold after". They come from
# BINS, one xz-compressed tar holding one binary per name (near-identical binaries compress to little more than one,
# which keeps a call's carry under its limit), or, for `before` and `after` without BINS, from BEFORE (default
# .gpu/x1/rewind.xz) and AFTER (default .gpu/kern/rewind.xz). Each is `cargo build --release -p rewind-bin
# --no-default-features --features cuda`, stripped: `bash bench/gpu/build_ab.sh before=REV after=REV` makes BINS.
# The kernel cache build_ab.sh writes beside BINS (KCACHE_ARCH) is used when carried. Everything comes back as
# $OUT/ab.tgz (plus run.log).
set -u
. bench/gpu/lib.sh
VARIANTS=${VARIANTS:-before after}
FIRST=${VARIANTS%% *}
LAST=${VARIANTS##* }
if [ -n "${BINS:-}" ]; then
  xz -dc $BINS | tar -C /tmp -xf - $VARIANTS
else
  xz -dc ${BEFORE:-.gpu/x1/rewind.xz} > /tmp/before && xz -dc ${AFTER:-.gpu/kern/rewind.xz} > /tmp/after
fi
for v in $VARIANTS; do chmod +x /tmp/$v; done
[ -n "${BINS:-}" ] && use_kcache $(dirname $BINS)/kcache.tar.xz
D=$OUT/ab
mkdir -p $D
trap 'cp $D/run.log $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/ab.tgz ab && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
date -u +%FT%TZ >> $D/device.txt
for v in $VARIANTS; do
  [ $v = $FIRST ] && continue
  timeout ${PARITY_S:-120} /tmp/$v selftest --device cuda --no-model --no-nccl --only replay \
    --json $D/parity-$v.json > $D/parity-$v.log 2>&1
  stamp "parity (replay cases) $v" $?
done
for round in 1 2; do
  for v in $VARIANTS; do
    f=$D/kernels-$v-$round
    timeout ${KERNELS_S:-90} /tmp/$v bench kernels --device cuda --family ${FAMILY:-all} --batch ${BATCH:-1,64,256} \
      --json $f.json --markdown $f.md > $f.log 2>&1
    stamp "kernels $v round $round" $?
  done
done
if [ "${SELFTEST:-1}" = 1 ]; then
  timeout ${SELFTEST_S:-240} /tmp/$LAST selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
fi
# End to end (E2E=1): the variants of E2E_VARIANTS (default: all) on one random model, E2E_MODEL q4b (qwen3.5-4b, GDN
# layers; the default) or n8b (nemotron-h-8b, Mamba-2 layers), the replay form with verify T = 4 at every kept count.
if [ "${E2E:-0}" = 1 ]; then
  M=${E2E_MODEL:-q4b}
  case $M in
    q4b) ARCH="--arch qwen3_5 --preset qwen3.5-4b" ;;
    n8b) ARCH="--arch nemotron_h --preset nemotron-h-8b" ;;
    *) echo "E2E_MODEL must be q4b or n8b" >> $L; exit 2 ;;
  esac
  /tmp/$LAST init-model $ARCH --seed 7 --out /tmp/$M > /dev/null 2>>$L
  stamp "init $M" $?
  for v in ${E2E_VARIANTS:-$VARIANTS}; do
    f=$D/$M-$v
    timeout ${E2E_S:-120} /tmp/$v bench --device cuda --model /tmp/$M --decode replay --batch ${E2E_BATCH:-64,256} \
      --prompt-len 1024 --step-prompt 16 --decode-tokens 16 --repeats 3 --verify-window 4 \
      --json $f.json > $f.md 2>>$L
    stamp "e2e $M $v" $?
  done
fi
