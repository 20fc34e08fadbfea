#!/usr/bin/env bash
# GPU workers against kvshard and against lmcache 0.5.6's `lmcache server`, in one run.
# First kvshard's own GPU checks (tools/gpu/selftest.sh on the executables of
# tools/gpu/pack.sh), then `lmcache bench server --mode gpu` in both transfer modes
# (plain, TP 2, MLA at TP 2), printing each configuration's checksum pass rate per
# server and the p50 ratios (kvshard / lmcache server) of warm retrieve and cold store.
#
# On a host without a GPU it prints why and exits 0: there is nothing to check.
# It exits 1 when lmcache server passes a configuration that kvshard does not, so a
# regression is loud; a configuration kvshard refuses by design (see the README's
# "GPU workers") is reported as such. Where `lmcache server` cannot start (a host
# whose packages it lacks), kvshard's results are printed alone and it exits 1 if a
# configuration whose bench ran reports a checksum that kvshard got wrong.
#
# Usage: tools/gpu/check.sh [path/to/kvshard]
# Env:   KVSHARD_GPU_DIR (executables from tools/gpu/pack.sh, default .gpu: built here
#        when it holds no kvshard), KVSHARD_LMCACHE_WHEELS (a folder from
#        tools/gpu/wheels.sh: lmcache 0.5.6 is installed from it offline and run with the
#        host's python3 and its CUDA torch, for GPU hosts without network; otherwise
#        KVSHARD_COMPAT_VENV, the lmcache 0.5.6 venv, installed when missing),
#        KVSHARD_GPU_REQUESTS (default 8).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu check: no GPU on this host (nvidia-smi is missing or lists no device); nothing to run"
    exit 0
fi
nvidia-smi -L
GPU_DIR="${KVSHARD_GPU_DIR:-.gpu}"
[ -x "$GPU_DIR/kvshard" ] || bash tools/gpu/pack.sh "$GPU_DIR" >/dev/null
bash tools/gpu/selftest.sh "$GPU_DIR" || { echo "gpu check: kvshard's own GPU checks failed"; exit 1; }

REQUESTS="${KVSHARD_GPU_REQUESTS:-8}"
if [ -n "${KVSHARD_LMCACHE_WHEELS:-}" ]; then
    SITE=$(mktemp -d)
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$KVSHARD_LMCACHE_WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
else
    VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
    if ! "$VENV/bin/python" -c "import lmcache, msgspec, zmq, torch" >/dev/null 2>&1; then
        echo "gpu check: installing lmcache==0.5.6 into $VENV (one time, several minutes)"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install --quiet --disable-pip-version-check lmcache==0.5.6
    fi
    PY="$VENV/bin/python"
fi
"$PY" - <<'PY' || { echo "gpu check: $PY's torch cannot use the GPU"; exit 1; }
import torch, sys
print(f"gpu check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
sys.exit(0 if torch.cuda.is_available() else 1)
PY

. tools/compat/common.sh
BIN="${1:-$GPU_DIR/kvshard}"
OUT=$(mktemp -d)
trap 'kill ${SERVER:-} 2>/dev/null || true; rm -rf "$OUT"' EXIT
export LMCACHE_DISABLE_BANNER=1

# CONFIG label -> extra bench arguments.
CONFIGS=(
    "lmcache_driven|--transfer-mode lmcache_driven --num-tokens 2048"
    "lmcache_driven-tp2|--transfer-mode lmcache_driven --num-tokens 1024 --tp-size 2"
    "lmcache_driven-tp2-mla|--transfer-mode lmcache_driven --num-tokens 1024 --tp-size 2 --use-mla --kvcache-shape-spec (1,1024,16,1,576):bfloat16:16"
    "engine_driven|--transfer-mode engine_driven --num-tokens 2048"
    "engine_driven-tp2|--transfer-mode engine_driven --num-tokens 1024 --tp-size 2"
    "engine_driven-tp2-mla|--transfer-mode engine_driven --num-tokens 1024 --tp-size 2 --use-mla --kvcache-shape-spec (1,1024,16,1,576):bfloat16:16"
)

run_server_benches() { # NAME PORT HTTP_PORT
    local name="$1" port="$2" http="$3" i=0 label args
    for c in "${CONFIGS[@]}"; do
        label="${c%%|*}"; args="${c#*|}"
        # shellcheck disable=SC2086
        timeout 900 "$PY" -m lmcache.cli.main bench server --mode gpu $args \
            --start "$((i * 1000))" --end "$((i * 1000 + REQUESTS))" \
            --rpc-url "tcp://127.0.0.1:$port" --url "http://127.0.0.1:$http" \
            --interval 0 --format json >"$OUT/$name.$label.json" 2>"$OUT/$name.$label.err" \
            || echo "gpu check: $name $label: bench exited non-zero (see below)"
        i=$((i + 1))
    done
}

# kvshard
P=$(free_port); H=$(free_port)
"$BIN" server --l1-size-gb 8 --eviction-policy LRU --supported-transfer-mode auto \
    --shm-name "gpuchk_k_$$" --port "$P" --http-port "$H" >"$OUT/kvshard.log" 2>&1 & SERVER=$!
wait_http "$H" || { echo "gpu check: kvshard did not start"; cat "$OUT/kvshard.log"; exit 1; }
run_server_benches kvshard "$P" "$H"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true

# lmcache server, same L1 size, SHM pool pre-allocated so engine_driven workers can pin it
P=$(free_port); H=$(free_port)
"$PY" -m lmcache.cli.main server --l1-size-gb 8 --eviction-policy LRU --supported-transfer-mode auto \
    --shm-name "gpuchk_p_$$" --no-l1-use-lazy --port "$P" --http-port "$H" >"$OUT/python.log" 2>&1 & SERVER=$!
if wait_http "$H" 300; then
    run_server_benches python "$P" "$H"
else
    echo "gpu check: lmcache server did not start on this host; kvshard's results alone. Its log ends:"
    tail -15 "$OUT/python.log"
fi
kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true
SERVER=

if grep -q "refused" "$OUT/kvshard.log"; then
    echo "gpu check: kvshard refused GPU registrations:"
    grep "refused" "$OUT/kvshard.log" | head -5
fi
python3 - "$OUT" "${CONFIGS[@]}" <<'PY'
import json, os, sys
out, configs = sys.argv[1], [c.split("|")[0] for c in sys.argv[2:]]

def load(server, label):
    path = os.path.join(out, f"{server}.{label}.json")
    try:
        text = open(path).read()
        start = text.index("{")
        return json.JSONDecoder().raw_decode(text[start:])[0]["metrics"]
    except (OSError, ValueError, KeyError):
        return None

def field(m, section, key):
    try:
        return m[section][key]
    except (KeyError, TypeError):
        return None

def rate(m):
    res = field(m, "results", "total_requests")
    ok = field(m, "results", "checksum_ok")
    return (ok or 0, res or 0)

regressions = 0
python_ran = any(os.path.exists(os.path.join(out, f"python.{l}.json")) for l in configs)
print(f"{'configuration':28} {'kvshard':>10} {'lmcache':>10} {'retrieve p50 ratio':>19} {'store p50 ratio':>16}")
for label in configs:
    k, p = load("kvshard", label), load("python", label)
    (kok, kn), (pok, pn) = rate(k), rate(p)
    ratios = []
    for section, key in (("warm_retrieve", "warm_retrieve_p50"), ("cold_store", "cold_store_p50")):
        a, b = field(k, section, key), field(p, section, key)
        ratios.append(f"{a / b:.2f}x" if a and b else "n/a")
    print(f"{label:28} {kok:>4}/{kn:<5} {pok:>4}/{pn:<5} {ratios[0]:>19} {ratios[1]:>16}")
    if python_ran:
        if pn and pok == pn and not (kn and kok == kn):
            regressions += 1
    elif k is None:
        # The bench client itself failed (its error is above): nothing of
        # kvshard's was measured.
        try:
            tail = open(os.path.join(out, f"kvshard.{label}.err")).read().strip().splitlines()[-1:]
        except OSError:
            tail = []
        print(f"  no result: the bench client failed{': ' + tail[0] if tail else ''}")
    elif kok != kn:
        regressions += 1
if regressions:
    against = "pass on lmcache server but not on kvshard" if python_ran else "fail their checksums on kvshard"
    print(f"gpu check: {regressions} configuration(s) {against}")
    sys.exit(1)
if not python_ran:
    print("gpu check: every configuration whose bench ran passes its checksums on kvshard")
    sys.exit(0)
print("gpu check: every configuration lmcache server passes also passes on kvshard")
PY
