"""A worker that outlives a server restart, with lmcache 0.5.6's own client.

Runs lmcache's bench client (its CPU workers, registered in TRANSFER_MODE) with
the real worker heartbeat of lmcache 0.5.6 (`HeartbeatThread` of its vLLM
adapter, whose recover callback re-registers the KV caches, as
`_reregister_kv_caches_callback` does) against a kvshard that this script
kills with SIGKILL and starts again on the same ports. Passes when, within two
heartbeat intervals of the restart, the worker has registered again and a
store, a lookup and a retrieve through it give back the stored bytes (the
bench's own checksums).

Usage: python restart.py KVSHARD_BIN TRANSFER_MODE   (run by tools/compat/run.sh
with the venv's python)
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HEARTBEAT_S = 2.0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(binary, args, log):
    """Starts kvshard and waits for its /healthcheck. A start that exits is
    tried again: the ports are ephemeral ones, and a client's connection
    attempt may hold one as its own port for a moment (a deployment's fixed
    ports are outside that range)."""
    http = args[args.index("--http-port") + 1]
    deadline = time.monotonic() + 60
    proc = subprocess.Popen([binary, *args], stdout=log, stderr=log)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            time.sleep(0.1)
            proc = subprocess.Popen([binary, *args], stdout=log, stderr=log)
            continue
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/healthcheck", timeout=1).read()
            return proc
        except Exception:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("restart: kvshard did not start")


def main():
    binary, mode = sys.argv[1], sys.argv[2]
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig
    from lmcache.cli.commands.bench.server_bench.helpers import (
        _DEFAULT_RPC_TIMEOUT_S,
        _MODEL_NAME,
    )
    from lmcache.integration.vllm.vllm_multi_process_adapter import HeartbeatThread
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo

    port, http = free_port(), free_port()
    args = ["server", "--l1-size-gb", "1", "--eviction-policy", "LRU",
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http),
            "--shm-name", f"compat_restart_{os.getpid()}"]
    log = open(os.environ.get("KVSHARD_RESTART_LOG", os.devnull), "ab")
    server = start_server(binary, args, log)
    logs = []
    config = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{port}", http_url=f"http://127.0.0.1:{http}",
        mode="cpu", transfer_mode=mode, tp_size=1, use_mla=False, num_tokens=1024,
        kvcache_shape_spec="(2,1024,16,8,128):float16:4", num_blocks=1024, block_size=16)
    client = ServerBenchClient(config, logs.append)
    client.start()
    worker = client._workers[0]
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(4)),
                              tokens_per_block=config.block_size)]
    registrations = []

    def reregister():
        # What the adapter's recover callback does: register the same KV
        # caches again, before the worker counts the server as healthy.
        worker.transfer_context.register(
            worker.kv_caches, _MODEL_NAME, 1, client._blocks_in_chunk,
            _DEFAULT_RPC_TIMEOUT_S, layout_hints={"kv_layout": "NHD"},
            engine_group_infos=groups, engine_type=EngineType.VLLM)
        registrations.append(time.monotonic())
        return True

    health = threading.Event()
    health.set()
    beat = HeartbeatThread(client._req_client, health, interval=HEARTBEAT_S,
                           instance_id=worker.spec.instance_id)
    beat.register_recover_callback(reregister)
    beat.start()

    def round_trip(seq):
        """Store, look up and retrieve request `seq`; whether every chunk came
        back with the bytes stored (the bench's checksums)."""
        req = client.create_request(seq, f"restart-{seq}-{time.monotonic_ns()}", "restart")
        n = req.num_full_tokens
        before = client.compute_checksums(req, 0, n)
        stored = client.store(req, 0, n)
        hits = client.lookup(req).hit_chunks
        client.zero_destination(req, 0, n)
        back = client.retrieve(req, 0, n)
        after = client.compute_checksums(req, 0, n)
        client.end_session(req)
        ok = (stored is not None and stored.succeeded and back is not None
              and back.succeeded and hits == req.total_chunks and before == after)
        return ok, hits, req.total_chunks

    try:
        ok, hits, total = round_trip(1)
        if not ok:
            raise SystemExit(f"restart ({mode}): the first round trip failed ({hits}/{total} hits)")
        server.send_signal(signal.SIGKILL)
        server.wait()
        server = start_server(binary, args, log)
        restarted = time.monotonic()
        # Two heartbeats: the first after the restart hears "unhealthy", the
        # second "healthy" and re-registers (with a little room for the
        # beats' own scheduling).
        bound = 2 * HEARTBEAT_S + 0.5
        deadline = restarted + bound
        while not (registrations and health.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not registrations or registrations[0] - restarted > bound:
            raise SystemExit(f"restart ({mode}): the worker did not register again within "
                             f"{2 * HEARTBEAT_S:.0f} s (two heartbeats) of the restart")
        took = registrations[0] - restarted
        ok, hits, total = round_trip(2)
        if not ok:
            raise SystemExit(f"restart ({mode}): after re-registering, the round trip failed "
                             f"({hits}/{total} hits)\n" + "\n".join(logs[-20:]))
        print(f"compat restart ({mode}): re-registered {took:.2f} s after the restart "
              f"(heartbeat {HEARTBEAT_S:.0f} s); store, lookup ({hits}/{total} hits) and "
              f"retrieve with checksums passing")
    finally:
        beat.stop()
        client.close()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
