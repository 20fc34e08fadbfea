"""Stand-in for vllm.v1.core.kv_cache_utils: the none hash every prefix chain starts from."""

import os
from typing import Any, Callable

if os.environ.get("VLLM_STANDIN_NO_KV_CACHE_UTILS"):
    # What importing vLLM's v1 core raises where torch cannot set up its device interface.
    raise AssertionError("vLLM stand-in: kv_cache_utils made unavailable")

NONE_HASH: bytes


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """PYTHONHASHSEED's hash when it is set, else 32 random bytes (vLLM's rule)."""
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED")
    NONE_HASH = os.urandom(32) if seed is None else hash_fn(seed)
