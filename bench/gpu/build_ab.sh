#!/usr/bin/env bash
# Builds, here (no GPU needed), the binaries that bench/gpu/replay_ab.sh compares: one per NAME=REV argument, each
# revision checked out in a temporary git worktree and built with `cargo build --release -p rewind-bin
# --no-default-features --features cuda` into this checkout's target/ (dependencies are built once), stripped and
# named NAME. All of them go into one xz-compressed tar with a dictionary large enough to span them, so
# near-identical binaries cost little more than one in a device call's carry.
#
# With KCACHE_ARCH (e.g. sm_90, the H100 / H200), each build also compiles its kernels into one kernel cache here
# (`rewind compile-kernels --fill-cache`), tarred as kcache.tar.xz beside the binaries: the device scripts that find
# it point REWIND_CACHE at it, so no build spends a minute of device time compiling its kernels. Builds share the
# images of the modules they did not change; a build that predates `--fill-cache` is skipped (it compiles on the
# device). A call's carry shares 64 MiB with the tracked tree (about 56 MiB, most of it the default models): two
# builds (about 7.1 MB) and their cache (about 0.7 MB) fit, with half a megabyte to spare; keep big result files
# under bench/results xz-compressed.
#
#   bash bench/gpu/build_ab.sh before=d8499f8 after=HEAD        # → .gpu/ab/bins.tar.xz
#   then, on a device:  VARIANTS="before after" BINS=.gpu/ab/bins.tar.xz bash bench/gpu/replay_ab.sh   (carry .gpu/ab)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: $0 NAME=REV [NAME=REV ...]" >&2; exit 2; }
ROOT=$PWD
OUTDIR=${OUTDIR:-.gpu/ab}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"; git worktree prune' EXIT
names=()
for spec in "$@"; do
  name=${spec%%=*}
  rev=${spec#*=}
  case $name in
    ''|*/*|*' '*) echo "bad name in \`$spec\`: expected NAME=REV" >&2; exit 2 ;;
  esac
  [ "$name" != "$spec" ] || { echo "bad argument \`$spec\`: expected NAME=REV" >&2; exit 2; }
  commit=$(git rev-parse --verify "$rev^{commit}") || { echo "unknown revision \`$rev\`" >&2; exit 2; }
  tree=$STAGE/tree-$name
  git worktree add --quiet --detach "$tree" "$commit"
  echo "building $name ($commit)" >&2
  (cd "$tree" && CARGO_TARGET_DIR="$ROOT/target" cargo build --quiet --release -p rewind-bin --no-default-features \
    --features cuda)
  cp "$ROOT/target/release/rewind" "$STAGE/$name"
  strip "$STAGE/$name"
  if [ -n "${KCACHE_ARCH:-}" ]; then
    if "$STAGE/$name" compile-kernels --help | grep -q -- --fill-cache; then
      scripts/nvrtc.sh
      LD_LIBRARY_PATH="$ROOT/target/nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" REWIND_CACHE="$STAGE/kcache" \
        "$STAGE/$name" compile-kernels --arch "$KCACHE_ARCH" --fill-cache | tail -1 >&2
    else
      echo "$name predates compile-kernels --fill-cache: its kernels will compile on the device" >&2
    fi
  fi
  git worktree remove --force "$tree"
  names+=("$name")
done
mkdir -p "$OUTDIR"
tar -C "$STAGE" -cf - "${names[@]}" | xz -T1 --lzma2=preset=9,dict=64MiB > "$OUTDIR/bins.tar.xz"
ls -l "$OUTDIR/bins.tar.xz" >&2
if [ -n "${KCACHE_ARCH:-}" ] && [ -d "$STAGE/kcache/nvrtc" ]; then
  tar -C "$STAGE/kcache" -cf - nvrtc | xz -T1 -9 > "$OUTDIR/kcache.tar.xz"
  ls -l "$OUTDIR/kcache.tar.xz" >&2
fi
echo "VARIANTS=\"${names[*]}\" BINS=$OUTDIR/bins.tar.xz bash bench/gpu/replay_ab.sh   # carry $OUTDIR" >&2
