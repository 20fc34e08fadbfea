#!/usr/bin/env python3
"""kvshard soak: hours-long behaviour in minutes.

Starts the server with a 1 GiB L1 and an fs L2, then for MINUTES runs
`kvshard loadgen` processes whose working set overfills the L1 (so it stays
about 95% full and evicts into L2), kills one of them with SIGKILL every
minute and starts it again, and sends malformed frames every few seconds.
Every few seconds it samples the server's RSS outside the L1 arena, its open
fds, CPU seconds, L1 use, lock counts and the latency of GET /status into a
CSV (and a PNG when matplotlib can be had).

Fails (exit 1) if RSS outside the arena grows by more than 5% from the end
of the warm-up to the end, if a lock count is not back to 0 once the clients
stopped and the TTLs ran out, if the instances of a killed client (which
pinged, as vLLM workers do) were not reaped by then, if any loadgen that ran
to its end read a wrong byte or saw a request fail or go unanswered, or if the
server died.

Usage: tools/soak.sh MINUTES [OUTDIR]   (the shell wrapper builds the binary)
       python3 tools/soak.py --bin PATH --minutes M [--out DIR]
"""

import argparse
import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SAMPLE_SECONDS = 5
KILL_EVERY_SECONDS = 60
BAD_FRAMES_EVERY_SECONDS = 3
LOADGENS = 4
INSTANCES_PER_LOADGEN = 2
# Locks, sessions and silent workers of killed clients expire after this.
TTL_SECONDS = 30


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(port, path, timeout=5.0):
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        body = r.read()
    return body, time.monotonic() - t0


def rss_outside_arena(pid):
    """RSS in bytes of every mapping but the L1 pool segment."""
    total = 0
    arena = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields:
                continue
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                # A mapping header: address perms offset dev inode [path]
                path = fields[5] if len(fields) > 5 else ""
                arena = "lmcache_l1_pool_" in path
            elif fields[0] == "Rss:" and not arena:
                total += int(fields[1]) * 1024
    return total


def metric_sum(port, name):
    """Sum of every series of metric `name` in /metrics (0 when absent)."""
    text, _ = http_get(port, "/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(rest[11]) + int(rest[12])) / tick


def send_bad_frames(port, rng):
    """Raw garbage on the ZeroMQ port, and, with pyzmq, malformed requests."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))))
    except OSError:
        pass
    try:
        import zmq  # noqa: PLC0415 (optional)
    except ImportError:
        return
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 2000)
    d.connect(f"tcp://127.0.0.1:{port}")
    frames = [
        [b"\x01", b"\xff\xff"],  # unknown op
        [b"\x02", b"\x08", b"\xc1"],  # lookup with a reserved msgpack byte
        [b"\x03", b"\x10", b"\x92\x01"],  # prepare_store, truncated
        [b"\x04", b"\x08", bytes(rng.getrandbits(8) for _ in range(64))],
    ]
    for f in frames:
        d.send_multipart(f)
    for _ in frames:
        try:
            d.recv_multipart()
        except zmq.Again:
            break
    d.close()


class Soak:
    def __init__(self, args):
        self.args = args
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="kvshard-soak-")
        self.port = free_port()
        self.http = free_port()
        self.shm = f"soak_{os.getpid()}"
        self.server = None
        self.loadgens = {}
        # How many times each slot was started: a restarted slot registers new
        # instance ids, so the killed one's go silent and are reaped.
        self.starts = {}
        self.kills = 0
        self.reports = []
        self.failures = []

    def start_server(self):
        l2 = json.dumps({"type": "fs", "base_path": os.path.join(self.tmp, "l2")})
        cmd = [
            self.args.bin, "server",
            "--l1-size-gb", "1", "--eviction-policy", "LRU",
            # Eviction keeps the L1 between about 90% and 95% full.
            "--eviction-trigger-watermark", "0.95", "--eviction-ratio", "0.05",
            "--port", str(self.port), "--http-port", str(self.http),
            "--shm-name", self.shm,
            "--l2-adapter", l2,
            "--l1-read-ttl-seconds", str(TTL_SECONDS),
            "--l1-write-ttl-seconds", str(TTL_SECONDS),
            "--session-ttl-seconds", str(TTL_SECONDS),
            "--worker-reap-timeout-seconds", str(TTL_SECONDS),
        ]
        self.server_log = open(os.path.join(self.out, "server.log"), "w")
        self.server = subprocess.Popen(cmd, stdout=self.server_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                http_get(self.http, "/healthcheck", 1)
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("soak: the server did not start; see server.log")

    def start_loadgen(self, slot, seconds):
        """Loadgen `slot`: 2 instances; the working set of all slots together
        is about 1.3x the L1 (each prompt's own chunks are 4 MiB). Its ranks
        ping every 5 s, as vLLM workers do (every 10 s)."""
        start = self.starts.get(slot, 0)
        self.starts[slot] = start + 1
        cmd = [
            self.args.bin, "loadgen", "--url", f"tcp://127.0.0.1:{self.port}",
            "--instances", str(INSTANCES_PER_LOADGEN), "--duration", str(max(1, int(seconds))),
            "--prompts", "340", "--zipf", "0.6", "--prompt-tokens", "2048",
            "--system-prompts", "4", "--system-prompt-tokens", "1024",
            "--first-instance-id", str(10_000 * (slot + 1) + 100 * start),
            "--heartbeat-seconds", "5",
            "--seed", "7", "--format", "json",
        ]
        if slot % 2 == 1:
            cmd += ["--rate", "40"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.loadgens[slot] = p

    def collect(self, slot, p):
        out, err = p.communicate()
        if p.returncode in (-signal.SIGKILL,):
            return
        try:
            r = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.failures.append(f"loadgen {slot} printed no report (rc {p.returncode}): {err[-300:]}")
            return
        self.reports.append(r)
        if r["wrong_chunks"] or r["unanswered"] or r["failed"]:
            self.failures.append(f"loadgen {slot}: {r['wrong_chunks']} wrong chunk(s), "
                                 f"{r['unanswered']} unanswered, {r['failed']} failed: "
                                 f"{r['first_error']}")

    def sample(self, writer, t0):
        pid = self.server.pid
        status, latency = http_get(self.http, "/status")
        l1 = json.loads(status)["storage_manager"]["l1_manager"]
        row = {
            "seconds": round(time.monotonic() - t0, 1),
            "rss_outside_arena_mib": round(rss_outside_arena(pid) / 2**20, 2),
            "open_fds": open_fds(pid),
            "cpu_seconds": round(cpu_seconds(pid), 2),
            "l1_usage": round(l1["memory_usage_ratio"], 4),
            "objects": l1["total_object_count"],
            "read_locked": l1["read_locked_count"],
            "write_locked": l1["write_locked_count"],
            "status_ms": round(latency * 1000, 2),
            # Objects read-locked while they are written behind to L2.
            "l2_inflight_store_mib": round(metric_sum(self.http, "kvshard_l2_inflight_store_bytes") / 2**20, 1),
            # Instances of killed clients the server reaped for their silence.
            "reaped_workers": int(metric_sum(self.http, "kvshard_reaped_workers_total")),
            "l2_store_backlog_chunks": int(
                metric_sum(self.http, "lmcache_mp_l2_store_submitted_objects_chunks_total")
                - metric_sum(self.http, "lmcache_mp_l2_store_completed_objects_chunks_total")),
        }
        writer.writerow(row)
        return row

    def run(self):
        rng = random.Random(11)
        self.start_server()
        total = self.args.minutes * 60
        t0 = time.monotonic()
        for slot in range(LOADGENS):
            self.start_loadgen(slot, total)
        rows = []
        csv_path = os.path.join(self.out, "soak.csv")
        with open(csv_path, "w", newline="") as f:
            fields = ["seconds", "rss_outside_arena_mib", "open_fds", "cpu_seconds", "l1_usage",
                      "objects", "read_locked", "write_locked", "status_ms",
                      "l2_inflight_store_mib", "l2_store_backlog_chunks", "reaped_workers"]
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            next_sample = next_kill = next_bad = t0
            next_kill += KILL_EVERY_SECONDS
            victim = 0
            while time.monotonic() - t0 < total:
                now = time.monotonic()
                if self.server.poll() is not None:
                    self.failures.append(f"the server exited with {self.server.returncode}")
                    break
                if now >= next_bad:
                    send_bad_frames(self.port, rng)
                    next_bad = now + BAD_FRAMES_EVERY_SECONDS
                if now >= next_kill:
                    p = self.loadgens[victim]
                    p.kill()
                    p.communicate()
                    self.kills += 1
                    left = total - (now - t0)
                    if left > 5:
                        self.start_loadgen(victim, left)
                    victim = (victim + 1) % LOADGENS
                    next_kill = now + KILL_EVERY_SECONDS
                if now >= next_sample:
                    rows.append(self.sample(w, t0))
                    f.flush()
                    next_sample = now + SAMPLE_SECONDS
                time.sleep(0.2)
            for slot, p in self.loadgens.items():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                self.collect(slot, p)
            # Locks of killed clients run out with their TTLs, and their
            # instances (which pinged) are reaped; then every count is 0.
            deadline = time.monotonic() + 3 * TTL_SECONDS + 30
            killed_instances = INSTANCES_PER_LOADGEN * self.kills
            while self.server.poll() is None:
                row = self.sample(w, t0)
                rows.append(row)
                if (row["read_locked"] == 0 and row["write_locked"] == 0
                        and row["reaped_workers"] >= killed_instances):
                    break
                if time.monotonic() > deadline:
                    self.failures.append(
                        f"{3 * TTL_SECONDS + 30} s after the load: {row['read_locked']} read and "
                        f"{row['write_locked']} write locks held, {row['reaped_workers']} of the "
                        f"{killed_instances} killed instances reaped")
                    break
                time.sleep(SAMPLE_SECONDS)
        self.judge(rows)
        self.plot(csv_path)
        self.stop()
        return rows

    def judge(self, rows):
        loaded = [r for r in rows if r["seconds"] <= self.args.minutes * 60]
        if len(loaded) < 4:
            self.failures.append("too few samples to judge")
            return
        warm = loaded[max(1, len(loaded) // 5)]  # end of warm-up: a fifth of the run
        end = loaded[-1]
        growth = (end["rss_outside_arena_mib"] - warm["rss_outside_arena_mib"]) / max(
            warm["rss_outside_arena_mib"], 1e-9)
        self.summary = {
            "minutes": self.args.minutes,
            "rss_after_warmup_mib": warm["rss_outside_arena_mib"],
            "rss_end_mib": end["rss_outside_arena_mib"],
            "rss_growth": round(growth, 4),
            "max_status_ms": max(r["status_ms"] for r in rows),
            "p99_status_ms": sorted(r["status_ms"] for r in rows)[int(0.99 * (len(rows) - 1))],
            "max_open_fds": max(r["open_fds"] for r in rows),
            "mean_l1_usage_after_warmup": round(
                sum(r["l1_usage"] for r in loaded[len(loaded) // 5:]) / max(1, len(loaded) - len(loaded) // 5), 3),
            "loadgen_reports": len(self.reports),
            "requests": sum(r["requests"] for r in self.reports),
            "wrong_chunks": sum(r["wrong_chunks"] for r in self.reports),
            "failed": sum(r["failed"] for r in self.reports),
            "loadgens_killed": self.kills,
            "instances_reaped": rows[-1]["reaped_workers"],
            "max_read_locked_after_warmup": max(r["read_locked"] for r in loaded[len(loaded) // 5:]),
        }
        if growth > 0.05:
            self.failures.append(f"RSS outside the arena grew {100 * growth:.1f}% after warm-up "
                                 f"({warm['rss_outside_arena_mib']} -> {end['rss_outside_arena_mib']} MiB)")

    def plot(self, csv_path):
        try:
            import matplotlib  # noqa: PLC0415 (optional)
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError:
            print("soak: matplotlib is not installed; no plot (the CSV has every sample)")
            return
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        t = [float(r["seconds"]) / 60 for r in rows]
        panels = [("rss_outside_arena_mib", "RSS outside L1 (MiB)"), ("open_fds", "open fds"),
                  ("l1_usage", "L1 usage"), ("read_locked", "read-locked objects"),
                  ("l2_inflight_store_mib", "L2 write-behind in flight (MiB)"),
                  ("status_ms", "GET /status (ms)"), ("cpu_seconds", "CPU seconds")]
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)), sharex=True)
        for ax, (key, label) in zip(axes, panels):
            ax.plot(t, [float(r[key]) for r in rows])
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("minutes")
        fig.suptitle(f"kvshard soak, {self.args.minutes} min")
        fig.tight_layout()
        fig.savefig(os.path.join(self.out, "soak.png"), dpi=90)

    def stop(self):
        if self.server and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
        for p in self.loadgens.values():
            if p.poll() is None:
                p.kill()
        subprocess.run(["rm", "-rf", self.tmp], check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = a.out or os.path.join(tempfile.gettempdir(), f"kvshard-soak-{int(time.time())}")
    s = Soak(a)
    try:
        s.run()
    finally:
        s.stop()
    print(f"soak: samples in {os.path.join(a.out, 'soak.csv')}")
    print("soak: " + json.dumps(getattr(s, "summary", {})))
    if s.failures:
        for f in s.failures:
            print(f"soak: FAIL: {f}")
        sys.exit(1)
    print("soak: PASS")


if __name__ == "__main__":
    main()
