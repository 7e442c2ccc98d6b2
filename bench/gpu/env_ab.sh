#!/usr/bin/env bash
# One build under several environments side by side on one GPU in one call: for a change that keeps the old path
# selectable (e.g. REWIND_REPLAY_FUSED=1, the one-pass Mamba-2 replay kernel for every row), so a single binary
# carries both and the A/B needs no second build. Runs the replay parity cases, `rewind bench kernels` of every
# variant alternated (A B A B), with E2E=1 the whole-step bench of every variant on each model of MODELS
# (arch:preset:layers, random weights, seed 7; E2E_VARIANTS names the variants it runs, default all), then the whole
# self-test.
#
# VARIANTS: space-separated NAME=ENV pairs, ENV a comma-separated list of VAR=VALUE (empty: the defaults), e.g.
#   VARIANTS="fused=REWIND_REPLAY_FUSED=1 split=" bash bench/gpu/env_ab.sh          (carry .gpu/one)
# Carried: the stripped release build as .gpu/one/rewind.xz and its kernel cache beside it (kcache.tar.xz, from
# `rewind compile-kernels --fill-cache`). Everything comes back as $OUT/ab.tgz, plus run.log.
set -u
. bench/gpu/lib.sh
unpack_bin ${REWIND_XZ:-.gpu/one/rewind.xz}
out_dir ab
trap 'cp $D/run.log $OUT/ 2>/dev/null; tar -C $OUT -czf $OUT/ab.tgz ab && rm -rf $D' EXIT
names=()
declare -A envs
for spec in ${VARIANTS:-fused=REWIND_REPLAY_FUSED=1 split=}; do
  n=${spec%%=*}
  names+=("$n")
  envs[$n]=${spec#*=}
done
# ev NAME: NAME's environment as VAR=VALUE words, for `env`.
ev() { echo ${envs[$1]//,/ }; }
timeout ${PARITY_S:-120} $R selftest --device cuda --no-model --no-nccl --only ${PARITY_ONLY:-replay} \
  --json $D/parity.json > $D/parity.log 2>&1
stamp "parity (${PARITY_ONLY:-replay} cases)" $?
tail -1 $D/parity.log >> $L
for round in 1 2; do
  for n in "${names[@]}"; do
    f=$D/kernels-$n-$round
    timeout ${KERNELS_S:-90} env $(ev $n) $R bench kernels --device cuda --family ${FAMILY:-all} --batch ${BATCH:-64,256} \
      --json $f.json --markdown $f.md > $f.log 2>&1
    stamp "kernels $n round $round" $?
  done
done
if [ "${E2E:-0}" = 1 ]; then
  for spec in ${MODELS:-nemotron_h:nemotron-h-8b:0}; do
    init_model $R $spec
    for n in ${E2E_VARIANTS:-${names[@]}}; do
      f=$D/$preset-$layers-$n
      timeout ${E2E_S:-130} env $(ev $n) $R bench --device cuda --model $m --decode replay --batch ${E2E_BATCH:-64,256} \
        --prompt-len 1024 --step-prompt 16 --decode-tokens 16 --repeats 3 --verify-window 4 \
        --json $f.json > $f.md 2> $f.log
      stamp "e2e $preset $layers $n" $?
    done
    rm -rf $m
  done
fi
if [ "${SELFTEST:-1}" = 1 ]; then
  timeout ${SELFTEST_S:-200} $R selftest --device cuda --fixtures tests/fixtures --trained-models models/default \
    --json $D/selftest.json > $D/selftest.log 2>&1
  stamp selftest $?
  tail -1 $D/selftest.log >> $L
fi
