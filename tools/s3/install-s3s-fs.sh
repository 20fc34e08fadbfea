#!/usr/bin/env bash
# Installs s3s-fs 0.14.1 (the S3 server the s3-raw tests run against) into
# $HOME/.cache/kvshard/s3s-fs-0.14.1 unless it is already there, then prints
# the binary's path. 0.14.1 is the newest release that builds with rustc
# 1.95; a cold build takes about 5 minutes on 2 cores.
#
# If another process is installing it right now (its cargo holds the lock on
# the same root), this waits for that install instead of starting a second
# one: set KVSHARD_S3S_WAIT_SECONDS (default 900) to bound the wait.
set -euo pipefail

version=0.14.1
root="${KVSHARD_S3S_ROOT:-$HOME/.cache/kvshard/s3s-fs-$version}"
bin="$root/bin/s3s-fs"
lock="$root.install.lock"

if [[ -x "$bin" ]]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$(dirname "$root")"
exec 9>"$lock"
if ! flock -n 9; then
    echo "s3s-fs $version: another install holds $lock; waiting" >&2
    flock -w "${KVSHARD_S3S_WAIT_SECONDS:-900}" 9
fi
if [[ ! -x "$bin" ]]; then
    cargo install s3s-fs --version "$version" --features binary --locked --root "$root" >&2
fi
if [[ ! -x "$bin" ]]; then
    echo "s3s-fs $version: install finished but $bin is missing" >&2
    exit 1
fi
echo "$bin"
