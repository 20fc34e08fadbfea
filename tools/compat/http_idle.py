#!/usr/bin/env python3
"""/healthcheck latency while idle clients hold HTTP connections open.

Starts each server given (kvshard, and `lmcache server` from the compat venv when
it is installed) on its own ports, opens N connections that each send a partial
request line and then wait, and times 20 GETs of /healthcheck on fresh
connections. Prints the median and the worst per server, measured in the same run.

Usage: tools/compat/http_idle.py [N] [path/to/kvshard]
       (defaults: N=1000, target/release/kvshard; the lmcache venv of
       tools/compat/run.sh, $KVSHARD_COMPAT_VENV, is used when present)
"""
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(port, path, timeout):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout).read()


def measure(label, argv, idle):
    port, http_port = free_port(), free_port()
    argv = argv + ["server", "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
                   "--port", str(port), "--http-port", str(http_port)]
    srv = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                get(http_port, "/healthcheck", 1)
                break
            except Exception:
                if time.monotonic() > deadline or srv.poll() is not None:
                    sys.exit(f"{label}: did not start")
                time.sleep(0.1)
        held = []
        for _ in range(idle):
            s = socket.create_connection(("127.0.0.1", http_port))
            s.sendall(b"GET /status HTTP/1.1\r\n")
            held.append(s)
        ms = []
        for _ in range(20):
            t = time.perf_counter()
            try:
                get(http_port, "/healthcheck", 5)
                ms.append((time.perf_counter() - t) * 1000)
            except Exception:
                ms.append(float("inf"))
        print(f"{label:>16}: /healthcheck with {idle} idle connections: "
              f"median {statistics.median(ms):.2f} ms, worst {max(ms):.2f} ms")
        for s in held:
            s.close()
    finally:
        srv.terminate()
        srv.wait()


def main():
    idle = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    binary = sys.argv[2] if len(sys.argv) > 2 else "target/release/kvshard"
    measure("kvshard", [binary, ], idle)
    venv = os.environ.get("KVSHARD_COMPAT_VENV",
                          os.path.expanduser("~/.cache/kvshard/lmcache-0.5.6"))
    lmcache = os.path.join(venv, "bin", "lmcache")
    if os.path.exists(lmcache):
        measure("lmcache server", [lmcache], idle)
    else:
        print(f"lmcache server: not installed in {venv} (run tools/compat/run.sh first)")


if __name__ == "__main__":
    main()
