#!/usr/bin/env bash
# kvshard beside lmcache 0.5.6's `lmcache server` under the same `kvshard loadgen`
# load, in one run: 8 engine_driven instances sending lookups only (every prompt
# stored first), then the full request mix (lookup, retrieve the hits, store the
# rest) at TP 1, TP 2 and MLA at TP 2, and lmcache_driven CPU workers. Prints
# each server's figures and the ratios; every byte read back is checked on both.
#
# Bar: kvshard sustains at least 4x the Python server's lookup throughput at an
# equal or lower p99. Exits 1 when a byte read back was wrong, a request went
# unanswered, or the bar is missed.
#
# Usage: tools/loadgen/compare.sh [SECONDS] [path/to/kvshard]   (default 10 s per load)
# Env:   KVSHARD_COMPAT_VENV (the lmcache 0.5.6 venv of tools/compat/run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/compat/common.sh
SECS="${1:-10}"
VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
need_client "loadgen compare"
kvshard_bin "${2:-}"
OUT=$(mktemp -d)
trap 'kill ${SERVER:-} 2>/dev/null || true; rm -rf "$OUT"' EXIT
export LMCACHE_DISABLE_BANNER=1
# Same flags for both: 4 GiB of L1, the SHM pool pre-faulted.
COMMON=(--l1-size-gb 4 --eviction-policy LRU --supported-transfer-mode auto --no-l1-use-lazy)

# LABEL -> loadgen arguments (each load uses its own model, so they do not share chunks).
LOADS=(
    "lookups|--instances 8 --lookup-only --prompts 512 --model lg-lookup"
    "mixed|--instances 8 --prompts 512 --model lg-mixed"
    "mixed-tp2|--instances 4 --tp 2 --prompts 256 --model lg-tp2"
    "mixed-mla-tp2|--instances 4 --tp 2 --mla --prompts 256 --model lg-mla"
    "lmcache-driven|--instances 4 --transfer-mode lmcache_driven --prompts 256 --model lg-lmc"
)

run_loads() { # NAME PORT
    local name="$1" port="$2" label args
    for l in "${LOADS[@]}"; do
        label="${l%%|*}"; args="${l#*|}"
        # shellcheck disable=SC2086
        "$BIN" loadgen --url "tcp://127.0.0.1:$port" --duration "$SECS" --format json $args \
            >"$OUT/$name.$label.json" || echo "loadgen compare: $name $label: loadgen exited non-zero"
    done
}

P=$(free_port); H=$(free_port)
"$BIN" server "${COMMON[@]}" --shm-name "lgcmp_k_$$" --port "$P" --http-port "$H" \
    >"$OUT/kvshard.log" 2>&1 & SERVER=$!
wait_http "$H" || { echo "loadgen compare: kvshard did not start"; tail -20 "$OUT/kvshard.log"; exit 1; }
run_loads kvshard "$P"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true

P=$(free_port); H=$(free_port)
"$VENV/bin/lmcache" server "${COMMON[@]}" --shm-name "lgcmp_p_$$" --port "$P" --http-port "$H" \
    >"$OUT/python.log" 2>&1 & SERVER=$!
wait_http "$H" 300 || { echo "loadgen compare: lmcache server did not start"; tail -20 "$OUT/python.log"; exit 1; }
run_loads python "$P"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
SERVER=

python3 - "$OUT" "${LOADS[@]}" <<'PY'
import json, sys
out, labels = sys.argv[1], [l.split("|")[0] for l in sys.argv[2:]]

def load(server, label):
    try:
        return json.load(open(f"{out}/{server}.{label}.json"))
    except (OSError, ValueError):
        return None

def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"

bad = 0
print(f"{'load':15} {'server':8} {'req/s':>9} {'lookups/s':>10} {'lookup p99':>11} {'request p99':>12} {'read GB/s':>10} {'write GB/s':>11} {'wrong':>6} {'failed':>7}")
for label in labels:
    rows = {s: load(s, label) for s in ("kvshard", "python")}
    for s, r in rows.items():
        if r is None:
            print(f"{label:15} {s:8} (no result)")
            bad += 1
            continue
        o = r["ops"]
        print(f"{label:15} {s:8} {r['requests_per_s']:9.0f} {r['lookups_per_s']:10.0f} "
              f"{o['lookup+status']['p99_us']:9}us {o['request']['p99_us']:10}us "
              f"{r['read_gb_per_s']:10.3f} {r['write_gb_per_s']:11.3f} {r['wrong_chunks']:6} "
              f"{r['failed'] + r['unanswered']:7}")
        if r["wrong_chunks"] or r["unanswered"] or r["failed"]:
            bad += 1
            print(f"  {s} {label}: {r['first_error']}")
    k, p = rows["kvshard"], rows["python"]
    if k and p:
        print(f"{label:15} ratio    {ratio(k['requests_per_s'], p['requests_per_s']):>9} "
              f"{ratio(k['lookups_per_s'], p['lookups_per_s']):>10} "
              f"{ratio(k['ops']['lookup+status']['p99_us'], p['ops']['lookup+status']['p99_us']):>11} "
              f"{ratio(k['ops']['request']['p99_us'], p['ops']['request']['p99_us']):>12}")
k, p = load("kvshard", "lookups"), load("python", "lookups")
if k and p and p["lookups_per_s"] > 0:
    t = k["lookups_per_s"] / p["lookups_per_s"]
    kp, pp = k["ops"]["lookup+status"]["p99_us"], p["ops"]["lookup+status"]["p99_us"]
    ok = t >= 4.0 and kp <= pp
    print(f"lookup throughput {t:.2f}x the Python server's at p99 {kp} us vs {pp} us "
          f"(bar: >= 4x at equal or lower p99) {'PASS' if ok else 'BELOW'}")
    bad += 0 if ok else 1
sys.exit(1 if bad else 0)
PY
