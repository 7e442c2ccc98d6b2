#!/usr/bin/env bash
# The replay kernels of several builds side by side on one GPU in one call: the replay parity cases of every build
# but the first, `rewind bench kernels` of every variant alternated (A B A B, so drift shows), the whole self-test of
# the last build, and with E2E=1 every variant end to end on one random model.
#
# VARIANTS (default "before after") names the variants in order. A variant is a binary's name, or NAME@S to run that
# binary with REWIND_REPLAY_STAGES=S (the replay kernels' pipeline forced to S = 2 or 3 stages), e.g.
# VARIANTS="before after@2 after". The binaries come from BINS, one xz-compressed tar holding one binary per name
# (near-identical binaries compress to little more than one, which keeps a call's carry under its limit), or, for the
# names `before` and `after` without BINS, from BEFORE (default .gpu/x1/rewind.xz) and AFTER (default
# .gpu/kern/rewind.xz). Each is `cargo build --release -p rewind-bin --no-default-features --features cuda`,
# stripped. Files of a variant NAME@S are named NAME-sS. Everything comes back as $OUT/ab.tgz (plus run.log).
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
VARIANTS=${VARIANTS:-before after}
BINARIES=$(for v in $VARIANTS; do echo ${v%@*}; done | awk '!seen[$0]++' | tr '\n' ' ')
FIRST=${BINARIES%% *}
LAST=$(echo $BINARIES | awk '{print $NF}')
if [ -n "${BINS:-}" ]; then
  xz -dc $BINS | tar -C /tmp -xf - $BINARIES
else
  xz -dc ${BEFORE:-.gpu/x1/rewind.xz} > /tmp/before && xz -dc ${AFTER:-.gpu/kern/rewind.xz} > /tmp/after
fi
for b in $BINARIES; do chmod +x /tmp/$b; done
D=$OUT/ab
mkdir -p $D
trap 'cp $D/run.log $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/ab.tgz ab && rm -rf $D' EXIT
L=$D/run.log
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }
# The command line of variant $1 (NAME or NAME@STAGES), for `timeout` to run.
variant() {
  case $1 in
    *@*) echo "env REWIND_REPLAY_STAGES=${1#*@} /tmp/${1%@*}" ;;
    *) echo "/tmp/$1" ;;
  esac
}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
date -u +%FT%TZ >> $D/device.txt
for b in $BINARIES; do
  [ $b = $FIRST ] && continue
  timeout ${PARITY_S:-120} /tmp/$b selftest --device cuda --no-model --no-nccl --only replay \
    --json $D/parity-$b.json > $D/parity-$b.log 2>&1
  stamp "parity (replay cases) $b" $?
done
for round in 1 2; do
  for v in $VARIANTS; do
    f=$D/kernels-${v/@/-s}-$round
    timeout ${KERNELS_S:-90} $(variant $v) bench kernels --device cuda --family ${FAMILY:-all} --batch ${BATCH:-1,64,256} \
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
    f=$D/$M-${v/@/-s}
    timeout ${E2E_S:-120} $(variant $v) bench --device cuda --model /tmp/$M --decode replay --batch ${E2E_BATCH:-64,256} \
      --prompt-len 1024 --step-prompt 16 --decode-tokens 16 --repeats 3 --verify-window 4 \
      --json $f.json > $f.md 2>>$L
    stamp "e2e $M $v" $?
  done
fi
