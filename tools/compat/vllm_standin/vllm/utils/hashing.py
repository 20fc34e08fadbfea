"""Stand-in for vllm.utils.hashing: the hash functions lmcache 0.5.6 asks for by name."""

import hashlib
import pickle
from typing import Any, Callable

import cbor2


def sha256(value: Any) -> bytes:
    """sha256 of the pickled value (vLLM's `sha256`)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """sha256 of the value's canonical CBOR encoding (vLLM's `sha256_cbor`)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    table = {"sha256": sha256, "sha256_cbor": sha256_cbor}
    if name not in table:
        raise ValueError(f"Unsupported hash function: {name}")
    return table[name]
