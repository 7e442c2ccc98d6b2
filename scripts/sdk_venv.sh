#!/usr/bin/env bash
# Puts a Python virtual environment with the official `openai` SDK (and `jsonschema`) under target/sdk-venv, once,
# from PyPI: `bin/tests/cli/openai_sdk.rs` drives a CPU server with it. Run from anywhere; prints nothing when the
# environment is already there at these versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS="openai==3.57.0 jsonschema==4.26.0"
DEST=target/sdk-venv
[ "$(cat "$DEST/PINS" 2>/dev/null)" = "$PINS" ] && exit 0
rm -rf "$DEST"
python3 -m venv "$DEST"
# shellcheck disable=SC2086
"$DEST/bin/python" -m pip install --quiet --disable-pip-version-check $PINS
echo "$PINS" > "$DEST/PINS"
