#!/usr/bin/env bash
# Soak test: `tools/soak.py` for MINUTES against a release build (see its header
# for what runs and what fails it). Puts soak.csv, soak.png and server.log in
# OUTDIR (default: a new folder under /tmp, printed at the end).
#
# Usage: tools/soak.sh MINUTES [OUTDIR]
# The plot and the malformed-request part need matplotlib and pyzmq; they are
# installed once into a cached venv (~/.cache/kvshard/soak-venv); without it
# the soak still runs, with raw garbage frames only and no plot.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${1:?usage: tools/soak.sh MINUTES [OUTDIR]}"
OUTDIR="${2:-}"
cargo build --release --bin kvshard
BIN="${CARGO_TARGET_DIR:-target}/release/kvshard"
VENV="$HOME/.cache/kvshard/soak-venv"
PY=python3
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import matplotlib, zmq" 2>/dev/null; then
    PY="$VENV/bin/python"
elif python3 -m venv "$VENV" >/dev/null 2>&1 \
    && "$VENV/bin/pip" install --quiet --disable-pip-version-check matplotlib pyzmq >/dev/null 2>&1; then
    PY="$VENV/bin/python"
else
    echo "soak: could not install matplotlib and pyzmq into $VENV; running without them"
fi
exec "$PY" tools/soak.py --bin "$BIN" --minutes "$MINUTES" ${OUTDIR:+--out "$OUTDIR"}
