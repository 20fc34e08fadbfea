#!/usr/bin/env bash
# The s3 adapter with the real lmcache 0.5.6 client, on a real S3 server on
# loopback (s3s-fs, which checks every signature):
#  1. kvshard stores through the client (32 MiB chunks: multipart uploads),
#     restarts with an empty L1, and every warm lookup hits from S3 with every
#     checksum passing (engine_driven and lmcache_driven);
#  2. two kvshard processes share one bucket: what one stored is a hit on the
#     other;
#  3. `kvshard server --config FILE` with an lmcache YAML S3 configuration
#     (local_cpu: False) does the same through the mapped adapter;
#  4. with --hash-algorithm sha256_cbor and the same PYTHONHASHSEED, lmcache server
#     (its own S3 adapter, vLLM's hashing from tools/compat/vllm_standin) and kvshard
#     write the same object names to a bucket, byte for byte the same objects, and
#     each reads the other's with every checksum passing.
# Usage: tools/compat/s3.sh [path/to/kvshard]   (run tools/compat/run.sh first: it installs the client)
set -euo pipefail
cd "$(dirname "$0")/../.."

. tools/compat/common.sh
VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
N="${KVSHARD_COMPAT_S3_REQUESTS:-4}"
TOKENS=1024 # 4 chunks of 256 tokens, 32 MiB objects with the bench's default shape
need_client compat-s3
S3S=$(bash tools/s3/install-s3s-fs.sh)
kvshard_bin "${1:-}"
export LMCACHE_DISABLE_BANNER=1
WORK=$(mktemp -d)
LOG="$WORK/server.log"
PIDS=()
S3PID=""
cleanup() {
    for p in "${PIDS[@]}" $S3PID; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

AK=compat-ak
SK=compat-secret
S3PORT=$(free_port)
mkdir -p "$WORK/s3/kv1" "$WORK/s3/kv2" "$WORK/s3/kv3" "$WORK/s3/sha-l" "$WORK/s3/sha-k"
"$S3S" --host 127.0.0.1 --port "$S3PORT" --access-key "$AK" --secret-key "$SK" \
    --domain "localhost:$S3PORT" "$WORK/s3" >"$WORK/s3s.log" 2>&1 &
S3PID=$!
adapter() { # bucket
    echo "{\"type\":\"s3\",\"s3_endpoint\":\"$1.localhost:$S3PORT\",\"s3_region\":\"us-east-1\",\"disable_tls\":true,\"aws_access_key_id\":\"$AK\",\"aws_secret_access_key\":\"$SK\"}"
}

START_ENV=() # extra environment for the next start
start_lmcache() { # [flags...]; sets PORT, HTTP
    PORT=$(free_port); HTTP=$(free_port)
    env "${START_ENV[@]}" "$VENV/bin/lmcache" server --l1-size-gb 2 --eviction-policy LRU \
        --supported-transfer-mode auto --host 127.0.0.1 --port "$PORT" --http-port "$HTTP" \
        --shm-name "s3c_$$_$PORT" --no-l1-use-lazy "$@" >"$LOG" 2>&1 &
    PIDS+=($!)
    # lmcache server takes a while to import torch.
    wait_http "$HTTP" 180 || { echo "compat-s3: lmcache server did not start"; cat "$LOG"; exit 1; }
}
start() { # [flags...]; sets PORT, HTTP
    PORT=$(free_port); HTTP=$(free_port)
    # Every warm lookup must hit from S3: 128 MiB a lookup from s3s-fs on a
    # shared machine can take longer than the 0.5 s default wait for L2, after
    # which a lookup concludes without it (tests/l2_health.rs checks that).
    env "${START_ENV[@]}" "$BIN" server --l1-size-gb 2 --eviction-policy LRU --host 127.0.0.1 --port "$PORT" \
        --http-port "$HTTP" --shm-name "s3c_$$_$PORT" --l2-prefetch-load-timeout 60 "$@" >"$LOG" 2>&1 &
    PIDS+=($!)
    wait_http "$HTTP" 60 || { echo "compat-s3: kvshard did not start"; cat "$LOG"; exit 1; }
}
stop_all() { for p in "${PIDS[@]}"; do kill "$p"; wait "$p" 2>/dev/null || true; done; PIDS=(); }
phase() { # store|load sums mode start port http
    "$VENV/bin/python" tools/compat/l2_restart.py "$1" "$2" --mode cpu --transfer-mode "$3" \
        --rpc-url "tcp://127.0.0.1:$5" --url "http://127.0.0.1:$6" \
        --num-tokens "$TOKENS" --start "$4" --end "$(($4 + N))" 2>"$WORK/client.err" \
        || { echo "compat-s3: $1 ($3) failed"; tail -20 "$WORK/client.err"; tail -30 "$LOG"; exit 1; }
}
wait_objects() { # bucket count
    python3 - "$WORK/s3/$1" "$2" <<'PY' || { echo "compat-s3: $2 objects did not reach bucket $1"; find "$WORK/s3/$1" -type f | wc -l; df -h "$WORK"; tail -20 "$LOG"; exit 1; }
import os, sys, time
d, want = sys.argv[1], int(sys.argv[2])
for _ in range(1200):
    if sum(len(files) for _, _, files in os.walk(d)) >= want:
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
PY
}
CHUNKS=$((N * TOKENS / 256)) # one kv rank

# 1. store -> restart -> load, both transfer modes.
for mode in engine_driven lmcache_driven; do
    start --l2-adapter "$(adapter kv1)"
    phase store "$WORK/sums-$mode" "$mode" 100 "$PORT" "$HTTP"
    wait_objects kv1 "$CHUNKS"
    for _ in $(seq 300); do
        [ "$(metric "$HTTP" lmcache_mp_l2_store_completed_objects_chunks_total)" -ge "$CHUNKS" ] && break; sleep 0.1
    done
    stop_all
    start --l2-adapter "$(adapter kv1)"
    phase load "$WORK/sums-$mode" "$mode" 100 "$PORT" "$HTTP"
    hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop_all
    [ "$hits" -eq "$CHUNKS" ] || { echo "compat-s3: restart ($mode): $hits of $CHUNKS keys came from S3"; exit 1; }
    rm -rf "$WORK/s3/kv1"; mkdir -p "$WORK/s3/kv1"
    echo "compat-s3: kvshard restart ($mode): $N/$N requests hit from S3 ($hits keys), checksums match"
done

# 2. Two servers on one bucket.
start --l2-adapter "$(adapter kv2)"; PA=$PORT; HA=$HTTP
start --l2-adapter "$(adapter kv2)"; PB=$PORT; HB=$HTTP
phase store "$WORK/sums-ab" engine_driven 200 "$PA" "$HA"
wait_objects kv2 "$CHUNKS"
for _ in $(seq 300); do
    [ "$(metric "$HA" lmcache_mp_l2_store_completed_objects_chunks_total)" -ge "$CHUNKS" ] && break; sleep 0.1
done
phase load "$WORK/sums-ab" engine_driven 200 "$PB" "$HB"
hits=$(metric "$HB" lmcache_mp_lookup_hit_l2_keys_total); stop_all
[ "$hits" -eq "$CHUNKS" ] || { echo "compat-s3: shared bucket: $hits of $CHUNKS keys came from S3"; exit 1; }
echo "compat-s3: two servers on one bucket: $N/$N requests stored by one hit on the other, checksums match"

# 3. --config with lmcache's YAML (local_cpu: False -> L1 only stages).
cat >"$WORK/s3.yaml" <<EOF
chunk_size: 256
local_cpu: False
max_local_cpu_size: 2
save_unfull_chunk: False
remote_url: "s3://kv3.localhost:$S3PORT"
remote_serde: "naive"
blocking_timeout_secs: 30
extra_config:
  s3_region: "us-east-1"
  s3_num_io_threads: 16
  s3_prefer_http2: False
  disable_tls: True
  save_chunk_meta: False
  aws_access_key_id: "$AK"
  aws_secret_access_key: "$SK"
EOF
start --config "$WORK/s3.yaml"
phase store "$WORK/sums-yaml" engine_driven 300 "$PORT" "$HTTP"
wait_objects kv3 "$CHUNKS"
for _ in $(seq 300); do
    [ "$(python3 -c "import json,urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:$HTTP/status'))['storage_manager']['l1_manager']['total_object_count'])")" = 0 ] && break
    sleep 0.1
done
phase load "$WORK/sums-yaml" engine_driven 300 "$PORT" "$HTTP"
hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop_all
[ "$hits" -eq "$CHUNKS" ] || { echo "compat-s3: --config: $hits of $CHUNKS keys came from S3"; exit 1; }
echo "compat-s3: --config (lmcache YAML, local_cpu False): $N/$N requests hit from S3 ($hits keys), checksums match"

# 4. sha256_cbor keys across lmcache server and kvshard, on S3. lmcache's adapter
# (awscrt) resolves the virtual-hosted bucket names through the system resolver,
# which does not know *.localhost: they go into /etc/hosts.
for h in sha-l.localhost sha-k.localhost; do
    getent hosts "$h" >/dev/null || echo "127.0.0.1 $h" >>/etc/hosts \
        || { echo "compat-s3: $h does not resolve and /etc/hosts is not writable (run as root)"; exit 1; }
done
objects() { (cd "$WORK/s3/$1" && find . -type f ! -name '.*' | sort); }
STANDIN="$(pwd)/tools/compat/vllm_standin"
START_ENV=(PYTHONHASHSEED=11 PYTHONPATH="$STANDIN")
start_lmcache --l2-adapter "$(adapter sha-l)" --hash-algorithm sha256_cbor
phase store "$WORK/sums-sha-l" engine_driven 400 "$PORT" "$HTTP"; wait_objects sha-l "$CHUNKS"; stop_all
START_ENV=(PYTHONHASHSEED=11)
start --l2-adapter "$(adapter sha-l)" --hash-algorithm sha256_cbor
phase load "$WORK/sums-sha-l" engine_driven 400 "$PORT" "$HTTP"
hits=$(metric "$HTTP" lmcache_mp_lookup_hit_l2_keys_total); stop_all
[ "$hits" -eq "$CHUNKS" ] || { echo "compat-s3: sha256_cbor: $hits of $CHUNKS keys lmcache server wrote came from S3"; exit 1; }
start --l2-adapter "$(adapter sha-k)" --hash-algorithm sha256_cbor
phase store "$WORK/sums-sha-k" engine_driven 400 "$PORT" "$HTTP"; wait_objects sha-k "$CHUNKS"
for _ in $(seq 300); do
    [ "$(metric "$HTTP" lmcache_mp_l2_store_completed_objects_chunks_total)" -ge "$CHUNKS" ] && break; sleep 0.1
done
stop_all
[ "$(objects sha-l)" = "$(objects sha-k)" ] \
    || { echo "compat-s3: sha256_cbor: the object names differ"; diff <(objects sha-l) <(objects sha-k); exit 1; }
for f in $(objects sha-l); do
    cmp -s "$WORK/s3/sha-l/$f" "$WORK/s3/sha-k/$f" \
        || { echo "compat-s3: sha256_cbor: object $f differs between lmcache server and kvshard"; exit 1; }
done
START_ENV=(PYTHONHASHSEED=11 PYTHONPATH="$STANDIN")
start_lmcache --l2-adapter "$(adapter sha-k)" --hash-algorithm sha256_cbor
phase load "$WORK/sums-sha-k" engine_driven 400 "$PORT" "$HTTP"; stop_all
START_ENV=()
echo "compat-s3: sha256_cbor: lmcache server and kvshard wrote the same $CHUNKS objects to S3, each read the other's, checksums match"
echo "compat-s3: all passed"
