#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets: fuzz/corpus/<target>/<sha1>.

Seeds come from the tests, so they follow the formats as the tests do:
- wire_request: lmcache 0.5.6's golden frames
  (wire/testdata/golden_cuda_register.json), the hex frames of the
  wire crate's tests, and a few small requests built here; each input is its
  frames after the uid, every frame as a little-endian u16 length and its bytes
  (the split fuzz/fuzz_targets/wire_request.rs reads back).
- http_request: requests to every route, with the bodies of transport/http's
  tests.
- s3_xml: the XML strings of s3-raw/tests/xml.rs.
- h1_response: responses framed each way HTTP/1.1 allows, behind the mode byte
  of fuzz/fuzz_targets/h1_response.rs.
- yaml_config: the YAML strings of src/yaml_config.rs's tests.
- resp_reply: the reply streams of resp/src/lib.rs's tests, and replies a
  Redis or Valkey server sends the L2 adapters (statuses, errors with MOVED
  and ASK, GET bodies, nil, a cluster's slot map), alone and back to back.

Run from anywhere: python3 fuzz/make-corpus.py. It replaces the seed
directories, so the result depends only on the sources.
"""

import hashlib
import json
import re
import shutil
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
# The committed corpus stays small; no single seed needs more than this.
MAX_SEED_BYTES = 64 * 1024


# ---------------------------------------------------------------- Rust literals


def _unescape(body):
    out = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        i += 2
        if n == "\n":
            # A line continuation drops the newline and the next line's indent.
            while i < len(body) and body[i] in " \t\r\n":
                i += 1
        elif n == "x":
            out.append(chr(int(body[i : i + 2], 16)))
            i += 2
        elif n == "u":
            end = body.index("}", i)
            out.append(chr(int(body[i + 1 : end], 16)))
            i = end + 1
        else:
            out.append({"n": "\n", "r": "\r", "t": "\t", "0": "\0"}.get(n, n))
    return "".join(out)


def rust_strings(text):
    """Every string literal of a Rust source, unescaped, in order."""
    out = []
    i = 0
    while i < len(text):
        if text.startswith("//", i):
            i = text.find("\n", i)
            if i < 0:
                break
            continue
        m = re.compile(r'b?r(#*)"').match(text, i)
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            end = text.index(close, m.end())
            out.append(text[m.end() : end])
            i = end + len(close)
            continue
        c = text[i]
        if c == "'":
            # A char literal ('x', '\n', '"'), else a lifetime.
            if text[i + 1] == "\\":
                i = text.index("'", i + 3) + 1
            elif i + 2 < len(text) and text[i + 2] == "'":
                i += 3
            else:
                i += 1
            continue
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(_unescape(text[i + 1 : j]))
            i = j + 1
            continue
        i += 1
    return out


def test_section(path):
    text = path.read_text()
    at = text.find("#[cfg(test)]")
    return text[at:] if at >= 0 else text


# ---------------------------------------------------------------- msgpack


def mp(v):
    """msgpack in its smallest form, as msgspec writes it (the subset used here)."""
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack("b", v)
        if 0 <= v < 1 << 8:
            return b"\xcc" + struct.pack(">B", v)
        if 0 <= v < 1 << 16:
            return b"\xcd" + struct.pack(">H", v)
        if 0 <= v < 1 << 32:
            return b"\xce" + struct.pack(">I", v)
        if 0 <= v:
            return b"\xcf" + struct.pack(">Q", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            return bytes([0xA0 | len(b)]) + b
        return b"\xd9" + bytes([len(b)]) + b
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list):
        assert len(v) < 16
        return bytes([0x90 | len(v)]) + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        assert len(v) < 16
        return bytes([0x80 | len(v)]) + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(v)


def frames_input(frames):
    return b"".join(struct.pack("<H", len(f)) + f for f in frames)


# ---------------------------------------------------------------- seeds


def wire_seeds():
    golden = json.loads((ROOT / "wire/testdata/golden_cuda_register.json").read_text())
    seeds = []
    key = None
    for name, v in golden.items():
        if isinstance(v, list):
            frames = [bytes.fromhex(f) for f in v[1:]]  # after the uid
            seeds.append(frames_input(frames))
            if name == "store":
                key = frames[1]
        elif not name.endswith("_decoded"):
            # One value (a descriptor, a reply): the op frame position holds it.
            seeds.append(frames_input([bytes.fromhex(v)]))
    for path in (ROOT / "wire/src").glob("*.rs"):
        for h in re.findall(r'unhex\("([0-9a-f]*)"\)', path.read_text()):
            seeds.append(frames_input([bytes.fromhex(h)]))
    # Small requests by legacy id and by name.
    seeds += [
        frames_input([mp(21)]),  # get_chunk_size
        frames_input([mp(24)]),  # noop
        frames_input([mp(32)]),  # get_experimental
        frames_input([mp(22), mp(0)]),  # ping
        frames_input([mp(20), mp(True)]),  # clear(force)
        frames_input([mp("clear")]),  # clear() by name
        frames_input([mp(13), mp("req-1")]),  # end_session
        frames_input([mp(9), mp("req-1")]),  # query_prefetch_status
        frames_input([mp(10), mp("req-1"), mp(5)]),  # wait_prefetch_status
        frames_input([mp(2), mp(3)]),  # unregister_kv_cache
        frames_input([mp(15), mp(3)]),  # unregister engine-driven context
        frames_input([mp(23), mp(0), mp("m"), mp([])]),  # report_block_allocation
        frames_input([mp("noop")]),
        frames_input([mp(11)]),  # retired id
        frames_input([b""]),  # stream control
    ]
    if key is not None:
        seeds += [
            frames_input([mp(8), key, mp(1)]),  # lookup
            frames_input([mp(12), key, mp(1)]),  # free_lookup_locks
            frames_input([mp(16), key, mp(0)]),  # prepare_store
            frames_input([mp(18), key, mp(0)]),  # prepare_retrieve
            frames_input([mp(19), key, mp(0)]),  # commit_retrieve
        ]
    return seeds


def http_seeds():
    def req(method, target, body=None):
        head = f"{method} {target} HTTP/1.1\r\nHost: localhost:8000\r\nUser-Agent: lmcache\r\n"
        if body is None:
            return (head + "\r\n").encode()
        b = body.encode()
        head += f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n"
        return head.encode() + b

    seeds = [
        req(m, t)
        for m, t in [
            ("GET", "/"),
            ("GET", "/healthcheck"),
            ("GET", "/status"),
            ("GET", "/status/"),
            ("HEAD", "/version"),
            ("GET", "/lmc_version"),
            ("GET", "/commit_id"),
            ("GET", "/config"),
            ("GET", "/config/adapters"),
            ("GET", "/metrics"),
            ("POST", "/metrics/reset"),
            ("GET", "/quota"),
            ("GET", "/quota/_default"),
            ("GET", "/quota/a%20b"),
            ("DELETE", "/quota/bob"),
            ("GET", "/quota/a/b"),
            ("GET", "/cache/objects"),
            ("GET", "/reconfigure/fs/l2/status"),
            ("GET", "/periodic-threads/x"),
            ("POST", "/run_script"),
            ("GET", "/nope?x=1"),
            ("PUT", "/status"),
            ("GET", "http://localhost:8000/status"),
        ]
    ]
    # The bodies transport/http's tests send.
    clear = ["", "null", "{}", '{"tier":"l1","force":true}', '{"force":"yes"}',
             '{"force":0,"extra":1}', '{"tier":"l2"}', '{"tier":"l3","force":"maybe"}',
             '{"tier":', "[1]"]
    checksums = ['{"block_ids":[3,4,"5",6.0,true],"chunk_size":2,"instance_id":7,"layerwise":1}',
                 '{"block_ids":[1],"chunk_size":1}', '{"block_ids":"abc","chunk_size":"x"}',
                 '{"block_ids":[1,"x",2.5,null],"chunk_size":1}', '{"block_ids":[],"chunk_size":1}',
                 '{"block_ids":[1],"chunk_size":99999999999999999999999}',
                 '{"block_ids":[1e30],"chunk_size":1,"instance_id":"-5"}']
    quota = ['{"limit_gb": 1.5}', '{"limit_gb": 0}', '{"limit_gb": "2.5"}', '{"limit_gb": " 1_000 "}',
             '{"limit_gb": true}', '{"limit_gb": 3, "other": NaN}', '{"limit_gb": -1}',
             '{"limit_gb": Infinity}', '{"limit_gb": "-inf"}', '{"limit_gb": "1__0"}',
             '{"limit_gb": "\\"NaN\\""}', '{"limit_gb": [1]}']
    seeds += [req("POST", "/cache/clear", b) for b in clear]
    seeds += [req("POST", "/cache/checksums", b) for b in checksums]
    seeds += [req("PUT", "/quota/x", b) for b in quota]
    return seeds


def xml_seeds():
    strings = rust_strings((ROOT / "s3-raw/tests/xml.rs").read_text())
    return [s.encode() for s in strings if s.lstrip("\ufeff \t\r\n").startswith("<")]


def h1_seeds():
    xml_error = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 "<Message>Reduce your request rate.</Message><RequestId>R1</RequestId></Error>")
    responses = [
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nETag: \"abc\"\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5;note=x\r\nhello\r\nA\r\n0123456789\r\n0\r\nx-trailer: done\r\n\r\n",
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        "HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n",
        "HTTP/1.0 200 OK\r\n\r\nuntil close",
        "HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 9\r\n\r\n"
        "3\r\nabc\r\n0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        f"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(xml_error)}\r\n\r\n{xml_error}",
    ]
    seeds = []
    # Mode byte: bit 7 HEAD, bits 3-4 the body reader, bits 0-2 the size.
    for r in responses:
        for mode in (0x06, 0x0F, 0x10, 0x18, 0x80):
            seeds.append(bytes([mode]) + r.encode())
    # A head past the connection's first 16 KiB buffer, and a body read
    # straight from the socket past what came with the head.
    seeds.append(b"\x0e" + ("HTTP/1.1 200 OK\r\nx-amz-meta-big: " + "h" * 20000
                            + "\r\nContent-Length: 2\r\n\r\nok").encode())
    seeds.append(b"\x0f" + ("HTTP/1.1 200 OK\r\nContent-Length: 30000\r\n\r\n" + "b" * 30000).encode())
    return seeds


def resp_seeds():
    strings = rust_strings(test_section(ROOT / "resp/src/lib.rs"))
    # The cluster tests hold CLUSTER SHARDS / SLOTS replies a real server sent.
    strings += rust_strings(test_section(ROOT / "resp/src/cluster.rs"))
    replies = [s.encode("latin-1") for s in strings if s[:1] in "+-:$*_"]
    body = bytes(range(256)) * 4
    replies += [
        b"+OK\r\n",
        b"+PONG\r\n",
        b":1\r\n",
        b":0\r\n",
        b"$-1\r\n",
        b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
        b"-MOVED 3999 127.0.0.1:6381\r\n",
        b"-ASK 3999 127.0.0.1:6381\r\n",
        b"-NOAUTH Authentication required.\r\n",
        b"$%d\r\n" % len(body) + body + b"\r\n",
        b"*3\r\n*3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$4\r\nabcd\r\n"
        b"*3\r\n:5461\r\n:10922\r\n*2\r\n$9\r\n127.0.0.1\r\n:7001\r\n"
        b"*3\r\n:10923\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:7002\r\n",
    ]
    return replies + [b"".join(replies[-6:]), b"".join(replies[:8])]


def yaml_seeds():
    strings = rust_strings(test_section(ROOT / "src/yaml_config.rs"))
    return [s.encode() for s in strings if ":" in s and "\n" in s]


def write(target, seeds):
    out = CORPUS / target
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seen = set()
    for s in seeds:
        if len(s) > MAX_SEED_BYTES:
            s = s[:MAX_SEED_BYTES]
        name = hashlib.sha1(s).hexdigest()
        if name not in seen:
            seen.add(name)
            (out / name).write_bytes(s)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{target}: {len(seen)} seeds, {size} bytes")
    if not seen:
        sys.exit(f"no seeds for {target}: did the sources move?")


def main():
    write("wire_request", wire_seeds())
    write("http_request", http_seeds())
    write("s3_xml", xml_seeds())
    write("h1_response", h1_seeds())
    write("yaml_config", yaml_seeds())
    write("resp_reply", resp_seeds())


if __name__ == "__main__":
    main()
