#!/usr/bin/env bash
# Downloads, here, the wheels that lmcache 0.5.6's GPU bench client needs on a
# GPU host that has python3 with a CUDA torch but no network: lmcache 0.5.6 and
# the packages its client imports that such hosts lack (CPython 3.12, x86-64 by
# default). tools/gpu/check.sh installs them there offline, without their
# dependencies, beside the host's own torch:
#   tools/gpu/pack.sh && tools/gpu/wheels.sh        (here)
#   KVSHARD_LMCACHE_WHEELS=.wheels tools/gpu/check.sh   (there, with .gpu/ and .wheels/)
#
# Usage: tools/gpu/wheels.sh [DIR]   (default .wheels; KVSHARD_WHEELS_PYTHON=3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-.wheels}"
PYV="${KVSHARD_WHEELS_PYTHON:-3.12}"
mkdir -p "$DIR"
# The versions a working lmcache 0.5.6 client runs with here; a GPU host's own
# packages (torch, numpy, prometheus_client, ...) are used as they are.
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" \
    lmcache==0.5.6 msgspec==0.22.0 pyzmq==27.3.0 nvtx==0.2.17 \
    opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 \
    opentelemetry-semantic-conventions==0.61b0 importlib_metadata==8.7.1 cachetools==8.0.2
ls -la "$DIR"
