#!/usr/bin/env bash
# The resp and valkey adapters with the real lmcache 0.5.6 client and server, on a
# real redis-server on loopback (Debian's, tools/redis/install.sh):
#  1. resp (lmcache_driven): a Redis written by `lmcache server`'s resp adapter (its
#     C++ connector) is read by kvshard started with an empty L1, every warm lookup a
#     hit with every checksum passing, and one written by kvshard is read by `lmcache
#     server`; both wrote the same keys with the same values, byte for byte;
#  2. valkey (engine_driven) (0.5.6's valkey-glide adapter, valkey-glide-sync installed here) with a
#     key_prefix: the same both ways, every key under `<prefix>@`.
# Usage: tools/compat/resp.sh [path/to/kvshard]   (run tools/compat/run.sh first: it installs the client)
set -euo pipefail
cd "$(dirname "$0")/../.."

. tools/compat/common.sh
VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
N="${KVSHARD_COMPAT_RESP_REQUESTS:-4}"
TOKENS=1024 # 4 chunks of 256 tokens, 32 MiB objects with the bench's default shape
need_client compat-resp
REDIS_DIR=$(bash tools/redis/install.sh)
"$VENV/bin/python" -c "import glide_sync" >/dev/null 2>&1 \
    || "$VENV/bin/pip" install --quiet --disable-pip-version-check valkey-glide-sync==2.6.0
kvshard_bin "${1:-}"
export LMCACHE_DISABLE_BANNER=1
WORK=$(mktemp -d)
LOG="$WORK/server.log"
PID=""
RPID=""
cleanup() {
    for p in $PID $RPID; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

RPORT=$(free_port)
"$REDIS_DIR/redis-server" --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$WORK" --logfile redis.log &
RPID=$!
for _ in $(seq 100); do "$REDIS_DIR/redis-cli" -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
rcli() { "$REDIS_DIR/redis-cli" -p "$RPORT" "$@"; }

start() { # kind (kvshard|lmcache) adapter-json [extra flags...]
    local kind="$1" adapter="$2"; shift 2
    PORT=$(free_port); HTTP=$(free_port)
    if [ "$kind" = kvshard ]; then
        "$BIN" server --l1-size-gb 2 --eviction-policy LRU --host 127.0.0.1 --port "$PORT" \
            --http-port "$HTTP" --shm-name "rc_$$_$PORT" --l2-adapter "$adapter" \
            --l2-prefetch-load-timeout 60 "$@" >"$LOG" 2>&1 &
    else
        "$VENV/bin/lmcache" server --l1-size-gb 2 --eviction-policy LRU --supported-transfer-mode auto \
            --host 127.0.0.1 --port "$PORT" --http-port "$HTTP" --shm-name "rc_$$_$PORT" --no-l1-use-lazy \
            --l2-adapter "$adapter" "$@" >"$LOG" 2>&1 &
    fi
    PID=$!
    # lmcache server takes a while to import torch.
    wait_http "$HTTP" 180 || { echo "compat-resp: $kind did not start"; cat "$LOG"; exit 1; }
}
stop() { kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""; }
phase() { # store|load sums mode start
    "$VENV/bin/python" tools/compat/l2_restart.py "$1" "$2" --mode cpu --transfer-mode "$3" \
        --rpc-url "tcp://127.0.0.1:$PORT" --url "http://127.0.0.1:$HTTP" \
        --num-tokens "$TOKENS" --start "$4" --end "$(($4 + N))" 2>"$WORK/client.err" \
        || { echo "compat-resp: $1 ($3) failed"; tail -20 "$WORK/client.err"; tail -30 "$LOG"; exit 1; }
}
CHUNKS=$((N * TOKENS / 256)) # one kv rank
wait_keys() { # count
    for _ in $(seq 600); do [ "$(rcli dbsize)" -ge "$1" ] && return 0; sleep 0.1; done
    echo "compat-resp: $1 keys did not reach Redis ($(rcli dbsize) did)"; tail -20 "$LOG"; exit 1
}
# Every key with the SHA-256 of its value, sorted.
snapshot() {
    "$VENV/bin/python" - "$RPORT" <<'PY'
import hashlib, sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
for k in sorted(r.scan_iter(count=1000)):
    print(k.decode(), hashlib.sha256(r.get(k)).hexdigest())
PY
}
RESP="{\"type\":\"resp\",\"host\":\"127.0.0.1\",\"port\":$RPORT}"

# lmcache server writes, kvshard reads; kvshard writes, lmcache server reads.
both_ways() { # label adapter-json mode start key-glob
    local label="$1" adapter="$2" mode="$3" at="$4" glob="$5"
    rcli flushall >/dev/null
    start lmcache "$adapter"; phase store "$WORK/sums-$label-l" "$mode" "$at"; wait_keys "$CHUNKS"; stop
    snapshot >"$WORK/snap-$label-l"
    start kvshard "$adapter"; phase load "$WORK/sums-$label-l" "$mode" "$at"
    hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop
    [ "$hits" -eq "$CHUNKS" ] || { echo "compat-resp: $label: $hits of $CHUNKS keys came from Redis"; exit 1; }
    rcli flushall >/dev/null
    start kvshard "$adapter"; phase store "$WORK/sums-$label-k" "$mode" "$at"; wait_keys "$CHUNKS"; stop
    snapshot >"$WORK/snap-$label-k"
    start lmcache "$adapter"; phase load "$WORK/sums-$label-k" "$mode" "$at"; stop
    [ "$(wc -l <"$WORK/snap-$label-k")" -eq "$CHUNKS" ] \
        || { echo "compat-resp: $label: kvshard wrote $(wc -l <"$WORK/snap-$label-k") keys, not $CHUNKS"; exit 1; }
    diff "$WORK/snap-$label-l" "$WORK/snap-$label-k" >/dev/null \
        || { echo "compat-resp: $label: the keys or values differ"; diff "$WORK/snap-$label-l" "$WORK/snap-$label-k" | head; exit 1; }
    # shellcheck disable=SC2053 # the glob is a pattern
    while read -r k _; do [[ "$k" == $glob ]] || { echo "compat-resp: $label: key $k is not $glob"; exit 1; }; done <"$WORK/snap-$label-k"
    echo "compat-resp: $label ($mode): lmcache server and kvshard wrote the same $CHUNKS keys byte for byte, each read the other's, checksums match"
}
both_ways resp "$RESP" lmcache_driven 200 'test-model@*'
VALKEY="{\"type\":\"valkey\",\"startup_nodes\":\"127.0.0.1:$RPORT\",\"key_prefix\":\"compat\",\"num_workers\":4}"
both_ways valkey "$VALKEY" engine_driven 300 'compat@test-model@*'
echo "compat-resp: all passed"
