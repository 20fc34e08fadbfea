#!/usr/bin/env bash
# Lints what tools/deploy ships, strictly (any finding fails):
#  - shellcheck on this script and on the undo scripts kvshard-plan writes for
#    each recorded fixture;
#  - `systemd-analyze verify` on kvshard.service with the drop-in kvshard-plan
#    fills for each fixture; a warning about either file fails too.
# Installs shellcheck and systemd with apt-get (Debian, Ubuntu) when missing.
#
#   bash tools/deploy/check.sh        # KVSHARD_BIN=path: the binary ExecStart names
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
need=()
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
if ((${#need[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "check.sh: ${need[*]} missing and no apt-get to install it" >&2
        exit 1
    fi
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        sudo=(sudo)
    fi
    echo "check.sh: installing ${need[*]}"
    "${sudo[@]}" apt-get update
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y "${need[@]}"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# systemd-analyze verify wants ExecStart's binary to exist.
bin=${KVSHARD_BIN:-}
if [ -z "$bin" ]; then
    bin=$tmp/kvshard
    printf '#!/bin/sh\nexit 0\n' >"$bin"
    chmod +x "$bin"
fi

fail=0
shellcheck "$here/check.sh" || fail=1

for args in "$here"/fixtures/*.args; do
    name=$(basename "$args" .args)
    mapfile -t plan_args <"$args"
    units=$tmp/$name/units
    mkdir -p "$units/kvshard.service.d"
    cp "$here/kvshard.service" "$units/"
    python3 "$here/kvshard-plan" --root "$here/fixtures/$name" "${plan_args[@]}" \
        --kvshard-bin "$bin" \
        --emit-dropin "$units/kvshard.service.d/plan.conf" \
        --emit-undo "$tmp/$name/undo.sh" >/dev/null

    echo "shellcheck: undo script of $name"
    shellcheck "$tmp/$name/undo.sh" || fail=1

    echo "systemd-analyze verify: kvshard.service with the drop-in of $name"
    if ! out=$(cd "$tmp/$name" && systemd-analyze verify "$units/kvshard.service" 2>&1); then
        echo "$out" >&2
        fail=1
    elif grep -q 'kvshard\.service' <<<"$out"; then
        echo "$out" >&2
        fail=1
    fi
done

if ((fail)); then
    echo "check.sh: FAILED" >&2
    exit 1
fi
echo "check.sh: ok"
