#!/usr/bin/env bash
# Puts NVRTC 13.0 (the device machines' CUDA; libnvrtc.so.13 and its builtins) under target/nvrtc/lib, once, from
# PyPI's nvidia-cuda-nvrtc wheel, so that the kernels can be compiled without a GPU: CI's check
# (kernels/tests/nvrtc_compile.rs with REWIND_NVRTC_CHECK) and `rewind compile-kernels`. It needs no driver, and the
# rest of CUDA stays absent. Run from anywhere; prints nothing when the library is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=13.0.88
DEST=target/nvrtc
[ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ] && exit 0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$TMP/wheel" \
  "nvidia-cuda-nvrtc==$VERSION"
python3 -c 'import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extractall(sys.argv[2])' \
  "$TMP/wheel" "$TMP/x"
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$TMP/x/nvidia/cu13/lib" "$DEST/lib"
echo "$VERSION" > "$DEST/VERSION"
