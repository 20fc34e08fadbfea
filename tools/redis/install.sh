#!/usr/bin/env bash
# Installs Debian's redis-server and redis-cli (the servers the resp and valkey
# adapter tests start on loopback) when they are missing; prints the directory
# that holds them. Concurrent runs wait for one another.
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    dirname "$(command -v redis-server)"
    exit 0
fi
SUDO=()
[ "$(id -u)" -eq 0 ] || SUDO=(sudo -n)
exec 9>"${TMPDIR:-/tmp}/kvshard-redis-install.lock"
flock 9
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "installing redis-server and redis-tools with apt-get" >&2
    "${SUDO[@]}" apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q redis-server redis-tools >&2
    # The package starts a system server on 6379; the tests start their own.
    "${SUDO[@]}" service redis-server stop >/dev/null 2>&1 || true
fi
dirname "$(command -v redis-server)"
