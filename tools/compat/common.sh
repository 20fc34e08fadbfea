# Shell helpers shared by the compat scripts (sourced, not run).

# A TCP port free on loopback right now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits until GET /healthcheck on 127.0.0.1:PORT answers; fails after SECONDS
# (default 120).
wait_http() { # PORT [SECONDS]
    python3 - "$1" "${2:-120}" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthcheck", timeout=1).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(1)
PY
}

# Sum of every series of metric NAME in /metrics on 127.0.0.1:PORT, as an integer.
metric() { # PORT NAME
    python3 - "$1" "$2" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(sys.argv[2] + " ") or l.startswith(sys.argv[2] + "{"))))
PY
}

# Fails with a hint unless the lmcache client is installed in $VENV.
need_client() { # LABEL
    "$VENV/bin/python" -c "import lmcache" 2>/dev/null || { echo "$1: run tools/compat/run.sh first"; exit 1; }
}

# Sets BIN to the given kvshard binary, or builds the release one.
kvshard_bin() { # [PATH]
    BIN="${1:-}"
    if [ -z "$BIN" ]; then
        cargo build --release --bin kvshard
        BIN=target/release/kvshard
    fi
}
