#!/usr/bin/env bash
# Drives kvshard with the real lmcache 0.5.6 client (`lmcache bench server --mode cpu`)
# in both transfer modes and fails unless every checksum passes.
#
# The client needs the full lmcache wheel (torch included, ~6 GB): it is installed once
# into a cached venv, $KVSHARD_COMPAT_VENV (default ~/.cache/kvshard/lmcache-0.5.6).
# Usage: tools/compat/run.sh [path/to/kvshard]   (default: a release build, built here; the client's
# checksum queries time out after 5 s, which a debug build can miss on a busy machine)
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
BIN="${1:-}"
REQUESTS="${KVSHARD_COMPAT_REQUESTS:-8}"

if ! "$VENV/bin/python" -c "import lmcache, msgspec, zmq" >/dev/null 2>&1; then
    echo "compat: installing lmcache==0.5.6 into $VENV (one time, several minutes)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check lmcache==0.5.6
fi
# vLLM's sha256_cbor (tools/compat/vllm_standin) encodes with cbor2.
"$VENV/bin/python" -c "import cbor2" >/dev/null 2>&1 \
    || "$VENV/bin/pip" install --quiet --disable-pip-version-check cbor2==5.7.1
if [ -z "$BIN" ]; then
    cargo build --release --bin kvshard
    BIN=target/release/kvshard
fi

. tools/compat/common.sh
PORT=$(free_port)
HTTP_PORT=$(free_port)
LOG=$(mktemp)
ARGS=(server --l1-size-gb 2 --eviction-policy LRU --host 127.0.0.1 --port "$PORT"
    --http-port "$HTTP_PORT" --shm-name "compat_$$")
"$BIN" "${ARGS[@]}" >"$LOG" 2>&1 &
SERVER=$!
LM_SERVER=
trap 'kill $SERVER $LM_SERVER 2>/dev/null; wait $SERVER $LM_SERVER 2>/dev/null; rm -f "$LOG" "$LOG.second" "$LOG.restart" "$LOG.lmcache"' EXIT
wait_http "$HTTP_PORT" || { echo "compat: kvshard did not start"; cat "$LOG"; exit 1; }

# The same command run twice: the second must fail naming the live server and
# leave its SHM pool alone (the benches below then need it).
if "$BIN" "${ARGS[@]}" >"$LOG.second" 2>&1; then
    echo "compat: a second server with the same --shm-name started"; exit 1
fi
grep -q "in use by process $SERVER" "$LOG.second" \
    || { echo "compat: the second start did not name the live server:"; cat "$LOG.second"; exit 1; }
echo "compat: a second start with the same --shm-name was refused and named process $SERVER"

export LMCACHE_DISABLE_BANNER=1
# The server the benches talk to: kvshard, until the hybrid specs run against
# lmcache server below.
TARGET=kvshard TARGET_PORT=$PORT TARGET_HTTP=$HTTP_PORT TARGET_LOG=$LOG
run_bench() {
    local mode="$1"; shift
    local out
    out=$(timeout 600 "$VENV/bin/lmcache" bench server --mode cpu --transfer-mode "$mode" \
        --rpc-url "tcp://127.0.0.1:$TARGET_PORT" --url "http://127.0.0.1:$TARGET_HTTP" \
        --interval 0 --format json "$@" 2>/dev/null) || { echo "compat: bench ($TARGET $mode $*) failed"; cat "$TARGET_LOG"; exit 1; }
    python3 - "$TARGET $mode $*" "$out" "${TARGET_STRICT:-1}" <<'PY'
import json, sys
label, text, strict = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
start = text.index("\n{") + 1 if not text.startswith("{") else 0
doc = json.JSONDecoder().raw_decode(text[start:])[0]
res = doc["metrics"]["results"]
ok, fail = res.get("checksum_ok"), res.get("checksum_fail")
total = res.get("total_requests")
print(f"compat {label}: {ok}/{total} checksums passed, {fail} failed")
# lmcache server answers a STORE before its chunks are committed, so the
# bench's immediate lookup can miss and that request's retrieve is skipped
# (counted neither way); it must still get no checksum wrong.
if not total or fail or not ok or (strict and ok != total):
    print(json.dumps(doc, indent=1))
    sys.exit(1)
PY
}
# Hybrid caches, several kernel groups each: two head counts and dtypes; MLA beside
# classical attention; three groups of fp8 (uint8), int8 and float32; TP 1 and 2.
# Each entry: first request id, TP size, shape spec.
HYBRID=(
    "5000 1 (2,1024,16,8,128):float16:4;(2,1024,16,4,64):bfloat16:4"
    "6000 2 (2,1024,16,8,128):float16:2;(1,1024,16,1,576):bfloat16:2"
    "7000 2 (2,1024,16,8,128):uint8:2;(2,1024,16,8,64):int8:1;(2,1024,16,2,64):float32:1"
)
run_hybrid() {
    local entry first tp spec
    for entry in "${HYBRID[@]}"; do
        read -r first tp spec <<<"$entry"
        run_bench lmcache_driven --start "$first" --end "$((first + REQUESTS))" --num-tokens 1024 \
            --tp-size "$tp" --kvcache-shape-spec "$spec"
    done
}

run_bench engine_driven --start 0 --end "$REQUESTS" --num-tokens 2048
run_bench lmcache_driven --start 1000 --end "$((1000 + REQUESTS))" --num-tokens 2048
run_bench engine_driven --start 2000 --end "$((2000 + REQUESTS))" --num-tokens 1024 --tp-size 2
run_bench lmcache_driven --start 3000 --end "$((3000 + REQUESTS))" --num-tokens 1024 --tp-size 2 --use-mla \
    --kvcache-shape-spec "(1,1024,16,1,576):bfloat16:16"
run_bench engine_driven --start 4000 --end "$((4000 + REQUESTS))" --num-tokens 1024 --tp-size 2 --use-mla \
    --kvcache-shape-spec "(1,1024,16,1,576):bfloat16:16"
run_hybrid
echo "compat: all checksums passed"

# lmcache server itself on the same hybrid specs, so each layout above is one
# 0.5.6 serves too (its own checksums, through its own kernel groups). It
# commits a STORE after answering it, so some of the bench's immediate lookups
# miss there and their requests are not checked: none may fail.
LM_PORT=$(free_port)
LM_HTTP=$(free_port)
"$VENV/bin/lmcache" server --l1-size-gb 2 --eviction-policy LRU --supported-transfer-mode auto \
    --host 127.0.0.1 --port "$LM_PORT" --http-port "$LM_HTTP" --shm-name "compat_lm_$$" \
    --no-l1-use-lazy >"$LOG.lmcache" 2>&1 &
LM_SERVER=$!
# lmcache server takes a while to import torch.
wait_http "$LM_HTTP" 180 || { echo "compat: lmcache server did not start"; cat "$LOG.lmcache"; exit 1; }
TARGET="lmcache-server" TARGET_PORT=$LM_PORT TARGET_HTTP=$LM_HTTP TARGET_LOG=$LOG.lmcache TARGET_STRICT=0
run_hybrid
kill "$LM_SERVER"; wait "$LM_SERVER" 2>/dev/null || true
LM_SERVER=
TARGET=kvshard TARGET_PORT=$PORT TARGET_HTTP=$HTTP_PORT TARGET_LOG=$LOG TARGET_STRICT=1
echo "compat: lmcache server got no checksum wrong on the same hybrid specs"

# The lmcache CLI's HTTP commands against the same server.
cli() {
    local out
    out=$("$VENV/bin/lmcache" "$@" --url "http://127.0.0.1:$HTTP_PORT" --format json 2>/dev/null) \
        || { echo "compat: lmcache $* failed"; exit 1; }
    printf '%s' "$out"
}
expect() { # label, text, python expression over `doc`
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
label, text, cond = sys.argv[1:4]
start = text.index("\n{") + 1 if not text.startswith("{") else 0
doc = json.JSONDecoder().raw_decode(text[start:])[0]
if not eval(cond, {"doc": doc, "json": json}):
    print(f"compat: lmcache {label}: unexpected output"); print(json.dumps(doc, indent=1)); sys.exit(1)
print(f"compat: lmcache {label}: ok")
PY
}
expect "ping kvcache" "$(cli ping kvcache)" 'doc["metrics"]["status"] == "OK"'
expect "describe kvcache" "$(cli describe kvcache)" \
    'doc["metrics"]["health"] == "OK" and doc["metrics"]["engine_type"] == "MPCacheServer"'
expect "quota set" "$(cli quota set tenant-a --limit-gb 1.5)" 'doc["metrics"]["status"] == "ok"'
expect "quota get" "$(cli quota get tenant-a)" 'doc["metrics"]["limit_gb"] == 1.5 and doc["metrics"]["exists"]'
expect "quota list" "$(cli quota list)" '"tenant-a" in json.dumps(doc["metrics"])'
expect "quota delete" "$(cli quota delete tenant-a)" 'doc["metrics"]["status"] == "removed"'
# `kvcache clear` has no --format option; read its text.
"$VENV/bin/lmcache" kvcache clear --url "http://127.0.0.1:$HTTP_PORT" 2>/dev/null | grep -Eq "Status: +OK" \
    || { echo "compat: lmcache kvcache clear failed"; exit 1; }
echo "compat: lmcache kvcache clear: ok"
echo "compat: lmcache CLI HTTP commands passed"

# A worker that outlives a server restart (SIGKILL, started again on the same
# ports) registers again through lmcache 0.5.6's own heartbeat within two
# heartbeats, and stores and retrieves with checksums passing.
for mode in engine_driven lmcache_driven; do
    "$VENV/bin/python" tools/compat/restart.py "$BIN" "$mode" 2>"$LOG.restart" \
        || { echo "compat: restart ($mode) failed"; tail -30 "$LOG.restart"; exit 1; }
done
rm -f "$LOG.restart"
