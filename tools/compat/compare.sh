#!/usr/bin/env bash
# Same-run comparison of kvshard with lmcache 0.5.6's own `lmcache server`, driven by
# `lmcache bench server --mode cpu` (engine_driven, SHM), and kvshard's resident
# memory outside the L1 arena.
# Usage: tools/compat/compare.sh [path/to/kvshard] (default target/release/kvshard)
# Env: KVSHARD_COMPARE_REQUESTS (default 40), KVSHARD_COMPARE_TOKENS (default 2048).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVSHARD_COMPAT_VENV:-$HOME/.cache/kvshard/lmcache-0.5.6}"
BIN="${1:-target/release/kvshard}"
N="${KVSHARD_COMPARE_REQUESTS:-40}"
TOKENS="${KVSHARD_COMPARE_TOKENS:-2048}"
[ -x "$BIN" ] || cargo build --release --bin kvshard
"$VENV/bin/python" -c "import lmcache" 2>/dev/null || { echo "run tools/compat/run.sh first (installs lmcache 0.5.6)"; exit 1; }
export LMCACHE_DISABLE_BANNER=1
OUT=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$OUT"' EXIT

. tools/compat/common.sh

bench() { # name port http_port
    "$VENV/bin/lmcache" bench server --mode cpu --rpc-url "tcp://127.0.0.1:$2" --url "http://127.0.0.1:$3" \
        --start 0 --end "$N" --interval 0 --num-tokens "$TOKENS" --format json 2>/dev/null > "$OUT/$1.json"
}

# kvshard
P=$(free_port); H=$(free_port)
"$BIN" server --l1-size-gb 4 --eviction-policy LRU --port "$P" --http-port "$H" --shm-name "cmp_k_$$" --no-l1-use-lazy \
    2>"$OUT/kvshard.log" & KPID=$!
wait_http "$H"
bench kvshard "$P" "$H"
grep -E "^(RssAnon|RssFile|RssShmem|VmRSS)" /proc/$KPID/status > "$OUT/kvshard.rss"
kill $KPID; wait $KPID 2>/dev/null || true

# lmcache server (Python), same L1 size and flags as the reference's recipe
P=$(free_port); H=$(free_port)
"$VENV/bin/lmcache" server --l1-size-gb 4 --eviction-policy LRU --supported-transfer-mode auto --shm-name "cmp_p_$$" \
    --no-l1-use-lazy --port "$P" --http-port "$H" >"$OUT/python.log" 2>&1 & PPID_=$!
wait_http "$H" || { echo "lmcache server did not start"; tail "$OUT/python.log"; exit 1; }
bench python "$P" "$H"
kill $PPID_; wait $PPID_ 2>/dev/null || true

python3 - "$OUT" <<'PY'
import json, sys, os
d = sys.argv[1]
def load(n):
    t = open(os.path.join(d, n + ".json")).read()
    s = t.index("\n{") + 1 if not t.startswith("{") else 0
    return json.JSONDecoder().raw_decode(t[s:])[0]["metrics"]
k, p = load("kvshard"), load("python")
print(f"{'(ms)':<20}{'kvshard':>10}{'lmcache':>10}{'lmcache/kvshard':>17}")
for group in ["cold_lookup", "warm_lookup", "cold_store", "warm_retrieve"]:
    for q in ["p50", "p99"]:
        a, b = k[group][f"{group}_{q}"], p[group][f"{group}_{q}"]
        print(f"{group + ' ' + q:<20}{a:>10.2f}{b:>10.2f}{b / a:>17.2f}")
for name, m in [("kvshard", k), ("lmcache", p)]:
    r = m["results"]
    print(f"{name}: {r['checksum_ok']}/{r['total_requests']} checksums passed")
rss = dict(l.split(":") for l in open(os.path.join(d, "kvshard.rss")))
kb = lambda f: int(rss[f].split()[0])
print(f"kvshard RSS outside the L1 arena (RssAnon+RssFile): {(kb('RssAnon') + kb('RssFile')) / 1024:.1f} MiB "
      f"(VmRSS {kb('VmRSS') / 1024:.1f} MiB, of which shared L1 pages {kb('RssShmem') / 1024:.1f} MiB)")
PY
