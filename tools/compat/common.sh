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
