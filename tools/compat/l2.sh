#!/usr/bin/env bash
# The L2 tier with the real lmcache 0.5.6 client and server:
#  1. kvshard with an fs adapter stores through the client, restarts with an empty
#     L1, and every warm lookup hits from L2 with every checksum passing
#     (engine_driven and lmcache_driven);
#  2. a directory written by `lmcache server`'s fs adapter is read by kvshard, and
#     one written by kvshard is read by `lmcache server`;
#  3. with --l2-store-policy skip_l1, L1 is empty once the stores are written
#     behind, and the warm lookups hit from L2 with every checksum passing;
#  4. with --hash-algorithm sha256_cbor and the same PYTHONHASHSEED, lmcache server
#     (vLLM's hashing from tools/compat/vllm_standin) and kvshard write the same
#     object names and read each other's, with vLLM's none hash and with the
#     fallback 0.5.6 uses where vLLM's kv_cache_utils does not import;
#  5. a hybrid KV cache (MLA beside classical attention, mixed dtypes, two kernel
#     groups) in lmcache_driven mode: lmcache server and kvshard write the same object
#     names and bytes, and each reads the other's with every checksum passing;
#  6. --separate-object-groups with sliding-window groups (full attention, a window
#     of two chunks, one shorter than a chunk: three object groups, one object per
#     chunk and group): both write the same object names (and bytes, but for the
#     unused tail of the sub-chunk window's objects), and each reads the other's,
#     every block the windows need matching and every other one left alone
#     (tools/compat/og_interop.py).
# Usage: tools/compat/l2.sh [path/to/kvshard]   (run tools/compat/run.sh first: it installs the client)
set -euo pipefail
cd "$(dirname "$0")/../.."

. tools/compat/common.sh
VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
N="${KVSHARD_COMPAT_L2_REQUESTS:-4}"
TOKENS=1024 # 4 chunks of 256 tokens, 32 MiB objects with the bench's default shape
need_client compat-l2
kvshard_bin "${1:-}"
export LMCACHE_DISABLE_BANNER=1
WORK=$(mktemp -d)
LOG="$WORK/server.log"
PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

START_ENV=() # extra environment for the next start
start() { # kind (kvshard|lmcache) dir [extra flags...]
    local kind="$1" dir="$2"; shift 2
    PORT=$(free_port); HTTP=$(free_port)
    local adapter="{\"type\":\"fs\",\"base_path\":\"$dir\"}"
    if [ "$kind" = kvshard ]; then
        # Every warm lookup must hit from L2: on a shared machine 128 MiB a
        # lookup can take longer than the 0.5 s default wait for L2, after
        # which a lookup concludes without it (tests/l2_health.rs checks that).
        env "${START_ENV[@]}" "$BIN" server --l1-size-gb 2 --eviction-policy LRU --host 127.0.0.1 --port "$PORT" \
            --http-port "$HTTP" --shm-name "l2c_$$_$PORT" --l2-adapter "$adapter" \
            --l2-prefetch-load-timeout 60 "$@" >"$LOG" 2>&1 &
    else
        env "${START_ENV[@]}" "$VENV/bin/lmcache" server --l1-size-gb 2 --eviction-policy LRU --supported-transfer-mode auto \
            --host 127.0.0.1 --port "$PORT" --http-port "$HTTP" --shm-name "l2c_$$_$PORT" --no-l1-use-lazy \
            --l2-adapter "$adapter" "$@" >"$LOG" 2>&1 &
    fi
    PID=$!
    # lmcache server takes a while to import torch.
    wait_http "$HTTP" 180 || { echo "compat-l2: $kind did not start"; cat "$LOG"; exit 1; }
}
stop() { kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""; }
wait_files() { # dir count
    python3 - "$1" "$2" <<'PY' || { echo "compat-l2: $2 objects did not reach $1"; ls "$1" | sort | uniq -c | sort -rn | head -3; ls "$1" | wc -l; tail -20 "$LOG"; exit 1; }
import os, sys, time
d, want = sys.argv[1], int(sys.argv[2])
for _ in range(600):
    if sum(n.endswith(".data") for n in os.listdir(d)) >= want:
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
PY
}
PHASE_ARGS=() # extra bench flags for the next phases
phase() { # store|load sums mode start
    "$VENV/bin/python" tools/compat/l2_restart.py "$1" "$2" --mode cpu --transfer-mode "$3" \
        --rpc-url "tcp://127.0.0.1:$PORT" --url "http://127.0.0.1:$HTTP" \
        --num-tokens "$TOKENS" --start "$4" --end "$(($4 + N))" "${PHASE_ARGS[@]}" 2>"$WORK/client.err" \
        || { echo "compat-l2: $1 ($3) failed"; tail -20 "$WORK/client.err"; tail -30 "$LOG"; exit 1; }
}
CHUNKS=$((N * TOKENS / 256)) # one kv rank

# 1. kvshard -> restart -> kvshard
for mode in engine_driven lmcache_driven; do
    dir="$WORK/kk-$mode"; mkdir -p "$dir"
    start kvshard "$dir"; phase store "$WORK/sums-$mode" "$mode" 100
    wait_files "$dir" "$CHUNKS"; stop
    start kvshard "$dir"; phase load "$WORK/sums-$mode" "$mode" 100
    hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop; rm -rf "$dir"
    echo "compat-l2: kvshard restart ($mode): $N/$N requests hit from L2, checksums match ($hits keys loaded)"
done

# 2. lmcache server writes, kvshard reads; kvshard writes, lmcache server reads.
dir="$WORK/pk"; mkdir -p "$dir"
start lmcache "$dir"; phase store "$WORK/sums-pk" engine_driven 200; wait_files "$dir" "$CHUNKS"; stop
start kvshard "$dir"; phase load "$WORK/sums-pk" engine_driven 200; stop; rm -rf "$dir"
echo "compat-l2: a directory written by lmcache server is read by kvshard"
dir="$WORK/kp"; mkdir -p "$dir"
start kvshard "$dir"; phase store "$WORK/sums-kp" engine_driven 300; wait_files "$dir" "$CHUNKS"; stop
start lmcache "$dir"; phase load "$WORK/sums-kp" engine_driven 300; stop; rm -rf "$dir"
echo "compat-l2: a directory written by kvshard is read by lmcache server"

# 3. skip_l1: L1 stays empty, hits come from L2 (same server, no restart).
l1_objects() {
    python3 - "$HTTP" <<'PY'
import json, sys, urllib.request
st = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/status", timeout=5))
print(st["storage_manager"]["l1_manager"]["total_object_count"])
PY
}
wait_l1_empty() {
    for _ in $(seq 200); do [ "$(l1_objects)" = 0 ] && return 0; sleep 0.1; done
    echo "compat-l2: skip_l1 left $(l1_objects) objects in L1"; exit 1
}
dir="$WORK/skip"; mkdir -p "$dir"
start kvshard "$dir" --l2-store-policy skip_l1 --eviction-policy noop
phase store "$WORK/sums-skip" engine_driven 400; wait_l1_empty
phase load "$WORK/sums-skip" engine_driven 400; wait_l1_empty
hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop; rm -rf "$dir"
[ "$hits" -eq "$CHUNKS" ] || { echo "compat-l2: skip_l1: $hits of $CHUNKS keys came from L2"; exit 1; }
echo "compat-l2: skip_l1: L1 empty after stores and retrieves, $N/$N requests hit from L2 ($hits keys), checksums match"
# 4. sha256_cbor keys, with vLLM's none hash and with 0.5.6's fallback.
names() { find "$1" -name '*.data' -printf '%f\n' | sort; }
STANDIN="$(pwd)/tools/compat/vllm_standin"
for from in vllm fallback; do
    dl="$WORK/sha-lmcache-$from"; dk="$WORK/sha-kvshard-$from"; mkdir -p "$dl" "$dk"
    START_ENV=(PYTHONHASHSEED=7 PYTHONPATH="$STANDIN")
    [ "$from" = fallback ] && START_ENV+=(VLLM_STANDIN_NO_KV_CACHE_UTILS=1)
    start lmcache "$dl" --hash-algorithm sha256_cbor
    phase store "$WORK/sums-sha-l-$from" engine_driven 500; wait_files "$dl" "$CHUNKS"; stop
    START_ENV=(PYTHONHASHSEED=7)
    start kvshard "$dl" --hash-algorithm sha256_cbor --sha256-cbor-none-hash "$from"
    phase load "$WORK/sums-sha-l-$from" engine_driven 500; stop
    start kvshard "$dk" --hash-algorithm sha256_cbor --sha256-cbor-none-hash "$from"
    phase store "$WORK/sums-sha-k-$from" engine_driven 500; wait_files "$dk" "$CHUNKS"; stop
    [ "$(names "$dl")" = "$(names "$dk")" ] \
        || { echo "compat-l2: sha256_cbor ($from): the object names differ"; diff <(names "$dl") <(names "$dk"); exit 1; }
    read="kvshard read lmcache server's"
    if [ "$from" = vllm ]; then # (the fallback's bytes are the same; its names are compared above)
        START_ENV=(PYTHONHASHSEED=7 PYTHONPATH="$STANDIN")
        start lmcache "$dk" --hash-algorithm sha256_cbor
        phase load "$WORK/sums-sha-k-$from" engine_driven 500; stop
        read="each read the other's"
    fi
    START_ENV=()
    rm -rf "$dl" "$dk"
    echo "compat-l2: sha256_cbor ($from none hash): lmcache server and kvshard wrote the same $CHUNKS object names, $read, checksums match"
done

# 5. A hybrid cache: one object per chunk holding both kernel groups' regions.
# kvshard writes with --separate-object-groups on (the groups share one object
# group all the same); lmcache server with it off.
PHASE_ARGS=(--kvcache-shape-spec "(2,1024,16,4,64):float16:2;(1,1024,16,1,576):bfloat16:1")
dl="$WORK/hy-lmcache"; dk="$WORK/hy-kvshard"; mkdir -p "$dl" "$dk"
start lmcache "$dl"; phase store "$WORK/sums-hy-l" lmcache_driven 600; wait_files "$dl" "$CHUNKS"; stop
start kvshard "$dl"; phase load "$WORK/sums-hy-l" lmcache_driven 600; stop
start kvshard "$dk" --separate-object-groups; phase store "$WORK/sums-hy-k" lmcache_driven 600
wait_files "$dk" "$CHUNKS"; stop
[ "$(names "$dl")" = "$(names "$dk")" ] \
    || { echo "compat-l2: hybrid: the object names differ"; diff <(names "$dl") <(names "$dk"); exit 1; }
for f in $(names "$dl"); do
    cmp -s "$(find "$dl" -name "$f")" "$(find "$dk" -name "$f")" \
        || { echo "compat-l2: hybrid: object $f differs between lmcache server and kvshard"; exit 1; }
done
start lmcache "$dk"; phase load "$WORK/sums-hy-k" lmcache_driven 600; stop
PHASE_ARGS=()
rm -rf "$dl" "$dk"
echo "compat-l2: hybrid cache (2 kernel groups): lmcache server and kvshard wrote the same $CHUNKS objects byte for byte, each read the other's, checksums match"
# 6. Separate object groups: full attention, a window of 512 tokens (2 chunks)
# and one of 64 (a sub-chunk window: 4 blocks of the chunk's last).
OG_ARGS=(--kvcache-shape-spec "(2,1024,16,4,64):float16:2;(2,1024,16,2,64):bfloat16:1;(2,1024,16,2,64):float16:1"
    --sw-size-tokens "-1,512,64")
og_phase() { # store|load sums start
    "$VENV/bin/python" tools/compat/og_interop.py "$1" "$2" --mode cpu --transfer-mode lmcache_driven \
        --rpc-url "tcp://127.0.0.1:$PORT" --url "http://127.0.0.1:$HTTP" \
        --num-tokens "$TOKENS" --start "$3" --end "$(($3 + N))" "${OG_ARGS[@]}" 2>"$WORK/client.err" \
        || { echo "compat-l2: separate object groups: $1 failed"; tail -20 "$WORK/client.err"; tail -30 "$LOG"; exit 1; }
}
dl="$WORK/og-lmcache"; dk="$WORK/og-kvshard"; mkdir -p "$dl" "$dk"
OBJECTS=$((3 * CHUNKS))
start lmcache "$dl" --separate-object-groups; og_phase store "$WORK/sums-og-l" 700
wait_files "$dl" "$OBJECTS"; stop
start kvshard "$dl" --separate-object-groups; og_phase load "$WORK/sums-og-l" 700; stop
start kvshard "$dk" --separate-object-groups; og_phase store "$WORK/sums-og-k" 700
wait_files "$dk" "$OBJECTS"; stop
[ "$(names "$dl")" = "$(names "$dk")" ] \
    || { echo "compat-l2: separate object groups: the object names differ"; diff <(names "$dl") <(names "$dk"); exit 1; }
for f in $(names "$dl"); do
    case "$f" in *@2@*) continue ;; esac # the sub-chunk window's tail is unused
    cmp -s "$(find "$dl" -name "$f")" "$(find "$dk" -name "$f")" \
        || { echo "compat-l2: separate object groups: object $f differs between lmcache server and kvshard"; exit 1; }
done
start lmcache "$dk" --separate-object-groups; og_phase load "$WORK/sums-og-k" 700; stop
rm -rf "$dl" "$dk"
echo "compat-l2: separate object groups (3 of them, windows of 2 chunks and 64 tokens): lmcache server and kvshard wrote the same $OBJECTS object names and bytes, each read the other's, every windowed block matches"
echo "compat-l2: all passed"
