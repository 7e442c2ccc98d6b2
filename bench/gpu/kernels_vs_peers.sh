#!/usr/bin/env bash
# SSM decode kernels beside their peers, one device call (issue 17, items 1 and 2):
#   rewind bench kernels   recurrent (step and replay kernels), replay at L = 4/8/16/32 and its flush step, verify at
#                          T = 2/4/6 (plain and flushing), the serial snapshot baseline (verify per T, commit per
#                          accepted count), batch 1..512, one Nemotron-H-8B Mamba-2 and one Qwen3.5-4B GDN layer;
#   bench/peers/ssm_decode.py   mamba_ssm's selective_state_update and fla's fused_recurrent_gated_delta_rule on the
#                          same shapes, batches and dtypes (rows in the same JSON schema, joined on family, kernel,
#                          batch, window).
# Carried: .gpu/kernels/rewind.xz (built on the host: cargo build --release -p rewind-bin --no-default-features
# --features cuda && mkdir -p .gpu/kernels && xz -T2 -c target/release/rewind > .gpu/kernels/rewind.xz; REWIND_XZ names
# another) and .whl/ (python3 bench/peers/ssm_decode.py fetch). KERNELS_ARGS adds flags to the rewind side (e.g.
# "--family gdn --batch 64,256").
set -u
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
xz -dc ${REWIND_XZ:-.gpu/kernels/rewind.xz} > /tmp/rewind && chmod +x /tmp/rewind
L=$OUT/run.log
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/device.txt
date -u +%FT%TZ >> $OUT/device.txt
# shellcheck disable=SC2086 # KERNELS_ARGS is a list of flags
timeout ${KERNELS_S:-300} /tmp/rewind bench kernels --device cuda ${KERNELS_ARGS:-} \
  --json $OUT/kernels.json --markdown $OUT/kernels.md > $OUT/kernels.log 2>&1
echo "rewind bench kernels rc $? at $(( $(date +%s) - t0 )) s" >> $L
timeout ${PEERS_S:-240} python3 bench/peers/ssm_decode.py --json $OUT/peers.json > $OUT/peers.log 2>&1
echo "peers rc $? at $(( $(date +%s) - t0 )) s" >> $L
