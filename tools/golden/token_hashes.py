"""Prints chunk hashes computed by lmcache 0.5.6's own TokenHasher with
--hash-algorithm sha256_cbor, as JSON, for kvshard's keys tests.

Run with the lmcache 0.5.6 virtualenv (cbor2 installed):

    ~/.cache/kvshard/lmcache-0.5.6/bin/python tools/golden/token_hashes.py \
        > engine/tests/data/token_hashes_sha256_cbor.json

vLLM's two hashing modules come from tools/compat/vllm_standin. Each case runs
0.5.6's hasher in a fresh interpreter, since its none hash is read from
PYTHONHASHSEED (vLLM's init_none_hash) once per process; `none_hash` "vllm" is
that path, "fallback" the one 0.5.6 takes where kv_cache_utils does not import.
"""

import json
import os
import subprocess
import sys

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "compat", "vllm_standin")


def tokens(case: str) -> list[int]:
    """Token lists covering every CBOR integer width and array-length head."""
    if case == "small":
        return list(range(1, 9))
    if case == "widths":
        # 0..23 (one byte), 24..255, 256..65535, 65536..2^32-1, in one sequence.
        vals = [0, 23, 24, 255, 256, 65535, 65536, 4294967295, 100000, 151643]
        return [vals[i % len(vals)] + (i // len(vals) if vals[i % len(vals)] < 4294967295 else 0) for i in range(600)]
    if case == "bench":
        return [0] + [9906] * 512
    raise ValueError(case)


# (PYTHONHASHSEED, none hash path, chunk size, token case)
CASES = [
    ("0", "vllm", 256, "bench"),
    ("7", "vllm", 4, "small"),
    ("7", "vllm", 24, "widths"),
    ("7", "vllm", 256, "widths"),
    ("7", "vllm", 300, "widths"),
    ("4294967295", "vllm", 16, "widths"),
    ("7", "fallback", 4, "small"),
    ("7", "fallback", 256, "widths"),
]

CHILD = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from lmcache.v1.multiprocess.token_hasher import TokenHasher
chunk, toks = json.loads(sys.stdin.read())
t = TokenHasher(chunk, "sha256_cbor")
assert t.hash_func.__module__ == "vllm.utils.hashing", t.hash_func
print(json.dumps([t.none_hash.hex(), [h.hex() for h in t.compute_chunk_hashes(toks)]]))
"""


def main() -> None:
    out = []
    for seed, none_hash, chunk, case in CASES:
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=STANDIN, LMCACHE_DISABLE_BANNER="1")
        env.pop("VLLM_STANDIN_NO_KV_CACHE_UTILS", None)
        if none_hash == "fallback":
            env["VLLM_STANDIN_NO_KV_CACHE_UTILS"] = "1"
        toks = tokens(case)
        res = subprocess.run(
            [sys.executable, "-c", CHILD], input=json.dumps([chunk, toks]), env=env,
            capture_output=True, text=True, check=True,
        )
        nh, hashes = json.loads(res.stdout.strip().splitlines()[-1])
        out.append({"python_hash_seed": seed, "none_hash_from": none_hash, "chunk_size": chunk,
                    "tokens": toks, "none_hash": nh, "hashes": hashes})
    json.dump({"source": "lmcache 0.5.6 TokenHasher(hash_algorithm='sha256_cbor')", "cases": out},
              sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
