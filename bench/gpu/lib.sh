# Shared preamble of the device scripts that source it (`. bench/gpu/lib.sh`): the library path gpu.md asks for,
# NCCL without NVLink multicast, the carried kernel cache, the output folder with its run log, and `stamp`.

export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0

# use_kcache TAR: a kernel cache warmed without a GPU (bench/gpu/build_ab.sh with KCACHE_ARCH), when it was carried,
# so that no build compiles its kernels on the device (about 50 s each). KCACHE overrides TAR.
use_kcache() {
  local kc=${KCACHE:-$1}
  if [ -f "$kc" ]; then
    mkdir -p /tmp/kcache && xz -dc "$kc" | tar -C /tmp/kcache -xf - && export REWIND_CACHE=/tmp/kcache
  fi
}

# out_dir NAME: D=$OUT/NAME with device.txt (the GPU and the date), L=$D/run.log; the caller's EXIT trap tars it (a
# call brings back only so many files).
out_dir() {
  D=$OUT/$1
  mkdir -p $D
  L=$D/run.log
  t0=$(date +%s)
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $D/device.txt
  date -u +%FT%TZ >> $D/device.txt
}

# stamp WHAT RC: one line of the run log with the seconds since out_dir.
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s" >> $L; }

# unpack_bin XZ: the carried build as R=/tmp/rewind, with the kernel cache carried beside it (use_kcache).
unpack_bin() {
  xz -dc "$1" > /tmp/rewind && chmod +x /tmp/rewind
  R=/tmp/rewind
  use_kcache "$(dirname "$1")/kcache.tar.xz"
}

# init_model BIN SPEC: the random model of SPEC (arch:preset:layers, 0 layers = the preset's own depth; seed 7) at
# m=/tmp/m-PRESET-LAYERS, written by BIN unless it is there already; sets arch, preset, layers and m, and stamps.
init_model() {
  IFS=: read -r arch preset layers <<< "$2"
  m=/tmp/m-$preset-$layers
  local extra=""
  [ "$layers" != 0 ] && extra="--layers $layers"
  [ -f $m/config.json ] || "$1" init-model --arch $arch --preset $preset $extra --out $m --seed 7 > /dev/null 2>>$L
  stamp "init $preset $layers" $?
}
