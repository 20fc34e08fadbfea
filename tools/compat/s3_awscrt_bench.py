"""PUT and GET throughput and client CPU of awscrt's S3 client (the client
lmcache 0.5.6's s3 adapter uses), set up as that adapter sets it up, against an
S3 endpoint on loopback. `cargo bench --bench s3` runs it in the same run as
kvshard's own client, on the same objects, as the baseline.

    python s3_awscrt_bench.py --host 127.0.0.1:PORT --bucket B --region R \
        --access-key AK --secret-key SK --size-mib 8 --concurrency 8 --count 32

Requests are path-style (`/<bucket>/<key>`, Host = the endpoint) so that no
DNS name is needed for the bucket; lmcache itself sends virtual-hosted requests,
which differ only in the Host header and path. Objects above 8 MiB go as
multipart uploads and ranged GETs, as the CRT does for lmcache.

Prints one JSON line per operation:
    {"op": "put"|"get", "size": bytes, "concurrency": n, "count": n,
     "seconds": wall, "cpu_seconds": user+sys of this process, "errors": n}
The CPU time is this whole process's (the CRT's event-loop threads and the
Python thread that drives them).
"""

# Standard
import argparse
import json
import os
import resource
import threading
import time

# Third Party
from awscrt import auth, io, s3
from awscrt.http import HttpHeaders, HttpRequest


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ViewStream:
    """A read-only stream over a memoryview (no copy), as lmcache's
    MemoryViewStream."""

    def __init__(self, view: memoryview):
        self.view = view
        self.offset = 0

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self.view) - self.offset)
        buf[:n] = self.view[self.offset : self.offset + n]
        self.offset += n
        return n

    def read(self, size=-1) -> bytes:
        if size < 0:
            size = len(self.view) - self.offset
        out = bytes(self.view[self.offset : self.offset + size])
        self.offset += len(out)
        return out

    def seek(self, offset, whence=0):
        if whence == 0:
            self.offset = offset
        elif whence == 1:
            self.offset += offset
        else:
            self.offset = len(self.view) + offset
        return self.offset

    def tell(self):
        return self.offset


def run(args) -> None:
    elg = io.EventLoopGroup(args.io_threads)
    resolver = io.DefaultHostResolver(elg)
    bootstrap = io.ClientBootstrap(elg, resolver)
    creds = auth.AwsCredentialsProvider.new_static(args.access_key, args.secret_key)
    client = s3.S3Client(
        bootstrap=bootstrap,
        region=args.region,
        tls_mode=s3.S3RequestTlsMode.DISABLED,
        credential_provider=creds,
    )
    size = args.size_mib << 20 if args.size_mib else args.size_bytes
    payload = bytearray(os.urandom(1 << 20)) * max(1, (size + (1 << 20) - 1) >> 20)
    payload = memoryview(payload)[:size]
    dest = [bytearray(size) for _ in range(args.concurrency)]
    keys = [f"{args.prefix}/awscrt-{size}-{i}" for i in range(args.count)]

    def request(method: str, key: str, slot: int):
        headers = HttpHeaders()
        headers.add("Host", args.host)
        body = None
        if method == "PUT":
            headers.add("Content-Length", str(size))
            headers.add("Content-Type", "application/octet-stream")
            body = ViewStream(payload)
        req = HttpRequest(method, f"/{args.bucket}/{key}", headers, body_stream=body)
        out = dest[slot]
        status = {}

        def on_body(chunk, offset, **kwargs):
            out[offset : offset + len(chunk)] = chunk

        def on_done(error=None, status_code=None, **kwargs):
            status["error"] = error
            status["code"] = status_code

        return (
            s3.S3Request(
                client=client,
                type=s3.S3RequestType.PUT_OBJECT
                if method == "PUT"
                else s3.S3RequestType.GET_OBJECT,
                request=req,
                on_body=on_body if method == "GET" else None,
                on_done=on_done,
                credential_provider=creds,
                region=args.region,
            ),
            status,
        )

    for op in ("put", "get"):
        errors = 0
        lock = threading.Lock()
        next_key = [0]

        def worker(slot: int):
            nonlocal errors
            while True:
                with lock:
                    i = next_key[0]
                    next_key[0] += 1
                if i >= len(keys):
                    return
                r, st = request(op.upper(), keys[i], slot)
                r.finished_future.result()
                ok = st.get("error") is None and st.get("code") in (200, 206)
                if op == "get" and ok and i == 0 and dest[slot] != payload:
                    ok = False
                if not ok:
                    with lock:
                        errors += 1

        threads = [
            threading.Thread(target=worker, args=(s,)) for s in range(args.concurrency)
        ]
        c0, t0 = cpu_seconds(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        print(
            json.dumps(
                {
                    "op": op,
                    "size": size,
                    "concurrency": args.concurrency,
                    "count": len(keys),
                    "seconds": wall,
                    "cpu_seconds": cpu,
                    "errors": errors,
                }
            ),
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", required=True, help="endpoint host:port")
    p.add_argument("--bucket", required=True)
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--access-key", required=True)
    p.add_argument("--secret-key", required=True)
    p.add_argument("--prefix", default="bench")
    p.add_argument("--size-mib", type=int, default=0)
    p.add_argument("--size-bytes", type=int, default=1 << 20)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--io-threads", type=int, default=64, help="lmcache's default")
    run(p.parse_args())


if __name__ == "__main__":
    main()
