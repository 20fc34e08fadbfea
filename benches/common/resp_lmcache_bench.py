"""Store and load throughput, and client CPU, of lmcache 0.5.6's `resp` L2
adapter against one Redis server: `NativeConnectorL2Adapter` over the C++
`LMCacheRedisClient`, built as `resp_l2_adapter.py`'s factory builds it, and
driven as 0.5.6's storage controllers drive it: one `submit_store_task` /
`submit_load_task` per batch, then `poll` on the adapter's store (load)
eventfd, drain it, and `pop_completed_store_tasks` (`query_load_result`)
until the task is done. `cargo bench --bench l2` (section 4) runs it in the
same run as kvshard's `RespAdapter`, on the same sizes, batches and bytes.

    python resp_lmcache_bench.py --host 127.0.0.1 --port PORT --num-workers 8 \
        --size 4194304 --cells 1:512,8:64,64:8

A cell `N:R` is R rounds of: store a batch of N objects (timed), load them
back into other buffers (timed), check the bytes, delete the keys (not
timed). Each round's objects carry a tag of their own in their first and last
8 bytes; the loaded bytes are checked at both ends and at a sampled stride
every round, and compared whole in the first round of each cell.

Prints one JSON object on stdout (lmcache's own logging goes to stderr):
    {"lmcache": "0.5.6", "size": bytes, "cells": [{"inflight": N,
     "rounds": R, "bytes": per direction, "store_seconds", "load_seconds",
     "store_cpu_seconds", "load_cpu_seconds", "verified": true}, ...]}
CPU seconds are this whole process's user+sys (getrusage RUSAGE_SELF: the
C++ client's worker threads, the adapter's demux thread and the Python
thread that submits and waits) over the timed calls only.
"""

# Standard
import argparse
import ctypes
import json
import os
import resource
import select
import struct
import sys
import time

# Stride of the sampled check: 64 bytes every this many bytes.
STRIDE = 1 << 20
MODEL = "l2bench"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class HostObj:
    """The part of an L1 `TensorMemoryObj` the adapter touches: `byte_array`,
    a ctypes-backed byte memoryview over the object's memory, as 0.5.6's
    `TensorMemoryObj.byte_array` builds it."""

    def __init__(self, size: int):
        self.buf = bytearray(size)
        self._arr = (ctypes.c_ubyte * size).from_buffer(self.buf)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self._arr)


def fill(buf: bytearray, seed: int) -> None:
    """Bytes that differ per seed and position (a 64-bit mix per word)."""
    # Third Party
    import numpy as np

    words = np.frombuffer(buf, dtype=np.uint64)
    x = np.arange(len(words), dtype=np.uint64)
    x += np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    words[:] = x


def tag(obj: HostObj, size: int, cell: int, rnd: int, i: int) -> None:
    t = struct.pack("<HHI", cell, i, rnd)
    obj.buf[0:8] = t
    obj.buf[size - 8 : size] = t


def sample_ranges(size: int):
    yield 0, 64
    yield size - 64, size
    for off in range(STRIDE // 2, size - 64, STRIDE):
        yield off, off + 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--cells", required=True, help="N:ROUNDS,...")
    args = ap.parse_args()
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]

    # lmcache logs to stdout in places: keep stdout for the result alone.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

    # First Party
    from lmcache.lmcache_redis import LMCacheRedisClient
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )
    from lmcache.v1.platform.event_notifier import consume_fd

    # As `_create_resp_l2_adapter` builds it.
    native = LMCacheRedisClient(args.host, args.port, args.num_workers, "", "")
    adapter = NativeConnectorL2Adapter(native, max_capacity_gb=0)

    # As the store and prefetch controllers wait: poll on the eventfd, drain
    # it, then collect what completed.
    store_efd = adapter.get_store_event_fd()
    store_poll = select.poll()
    store_poll.register(store_efd, select.POLLIN)
    load_efd = adapter.get_load_event_fd()
    load_poll = select.poll()
    load_poll.register(load_efd, select.POLLIN)

    def store(keys, objs):
        task = adapter.submit_store_task(keys, objs)
        while True:
            store_poll.poll()
            consume_fd(store_efd)
            done = adapter.pop_completed_store_tasks()
            if task in done:
                return done[task]

    def load(keys, objs):
        task = adapter.submit_load_task(keys, objs)
        while True:
            load_poll.poll()
            consume_fd(load_efd)
            res = adapter.query_load_result(task)
            if res is not None:
                return res

    size = args.size
    most = max(n for n, _ in cells)
    src = [HostObj(size) for _ in range(most)]
    dst = [HostObj(size) for _ in range(most)]
    for i, o in enumerate(src):
        fill(o.buf, 0x4000 + i)

    def key(cell: int, rnd: int, i: int) -> ObjectKey:
        h = bytearray(32)
        h[0:8] = struct.pack("<Q", rnd)
        h[8:16] = struct.pack("<Q", i)
        h[16:24] = struct.pack("<Q", cell)
        h[30] = 0x5A
        h[31] = 0xB5
        return ObjectKey(chunk_hash=bytes(h), model_name=MODEL, kv_rank=0)

    # Open the client's connections before timing anything.
    warm = [key(0xFFFF, 0, i) for i in range(min(8, most))]
    res = store(warm, src[: len(warm)])
    assert res.is_successful(), "warm-up store failed"
    bm = load(warm, dst[: len(warm)])
    assert bm.popcount() == len(warm), "warm-up load failed"
    adapter.delete(warm)

    results = []
    for c, (n, rounds) in enumerate(cells):
        st = ld = st_cpu = ld_cpu = 0.0
        for o in dst[:n]:
            o.buf[:] = bytes(size)
        for r in range(rounds):
            keys = [key(c, r, i) for i in range(n)]
            for i in range(n):
                tag(src[i], size, c, r, i)
                for a, b in sample_ranges(size):
                    dst[i].buf[a:b] = bytes(b - a)
            c0, t0 = cpu_seconds(), time.perf_counter()
            res = store(keys, src[:n])
            st += time.perf_counter() - t0
            st_cpu += cpu_seconds() - c0
            assert res.is_successful(), f"cell {n}: store round {r} failed"
            assert res.bytes_transferred() == n * size, (
                f"cell {n}: round {r} stored {res.bytes_transferred()} bytes"
            )
            c0, t0 = cpu_seconds(), time.perf_counter()
            bm = load(keys, dst[:n])
            ld += time.perf_counter() - t0
            ld_cpu += cpu_seconds() - c0
            assert bm.popcount() == n, f"cell {n}: round {r} loaded {bm.popcount()}/{n}"
            for i in range(n):
                for a, b in sample_ranges(size):
                    assert dst[i].buf[a:b] == src[i].buf[a:b], (
                        f"cell {n}: round {r} object {i}: bytes {a}..{b} differ"
                    )
                if r == 0:
                    assert dst[i].buf == src[i].buf, (
                        f"cell {n}: object {i}: loaded bytes differ"
                    )
            # Keep the server's footprint to one batch (not timed).
            adapter.delete(keys)
        results.append(
            {
                "inflight": n,
                "rounds": rounds,
                "bytes": n * rounds * size,
                "store_seconds": st,
                "load_seconds": ld,
                "store_cpu_seconds": st_cpu,
                "load_cpu_seconds": ld_cpu,
                "verified": True,
            }
        )
    adapter.close()
    out.write(json.dumps({"lmcache": "0.5.6", "size": size, "cells": results}) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
