"""Prints lmcache 0.5.6's S3 L2 adapter object names and request paths.

Run with the lmcache 0.5.6 virtualenv:

    ~/.cache/kvshard/lmcache-0.5.6/bin/python tools/golden/s3_names.py \
        > engine/tests/data/l2_s3_golden_names.txt

Each name is computed by 0.5.6's own code (``_object_key_to_string`` on a real
``ObjectKey``, and ``_format_safe_path`` for the HTTP path), and checked to
parse back through 0.5.6's ``_string_to_object_key``.

Output: '#' comment lines, then one line per key with tab-separated fields
    chunk_hash_hex  model_name  kv_rank(decimal)  object_group_id  cache_salt  object_name  request_path
(cache_salt may be empty).
"""

# Standard
import hashlib
import logging
import sys

logging.disable(logging.CRITICAL)

# First Party
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.s3_l2_adapter import (  # noqa: E402
    _format_safe_path,
    _object_key_to_string,
    _string_to_object_key,
)


def chunk_hash(i: int) -> bytes:
    return hashlib.sha256(f"kvshard-s3-golden-{i}".encode()).digest()


# (model_name, kv_rank, object_group_id, cache_salt, chunk hash)
CASES = [
    ("org/test-model", 0, 0, "", chunk_hash(0)),
    ("org/test-model", 1, 0, "", chunk_hash(1)),
    ("meta-llama/Llama-3.1-8B-Instruct", 0x00020001, 0, "", chunk_hash(2)),
    ("meta-llama/Llama-3.1-8B-Instruct", 0x01000100, 3, "", chunk_hash(3)),
    ("Qwen/Qwen2.5-7B", 0x04020402, 3, "tenant-a", chunk_hash(4)),
    ("gpt2", 0x01000100, 0, "user_42", chunk_hash(5)),
    ("org/sub/deep-model", 0x08070403, 0x1F, "", chunk_hash(6)),
    ("model with spaces+plus~tilde", 0xFFFFFFFF, 0, "s", chunk_hash(7)),
    ("org/model-7B", 0x01000100, 0, "salt.with.dots-and-dashes", chunk_hash(8)),
    ("org/model-7B", 0x01000100, 3, "", bytes(32)),
    ("mod%el", 0, 0x10, "", bytes([0xFF]) * 32),
    ("/leading-slash", 0x02010201, 1, "x" * 128, chunk_hash(11)),
    ("caf\u00e9-\u6a21\u578b", 7, 2, "t\u00fcr", chunk_hash(12)),
]


def main() -> None:
    out = sys.stdout
    out.write("# lmcache 0.5.6 s3 L2 adapter object names (tools/golden/s3_names.py)\n")
    out.write(
        "# chunk_hash_hex\tmodel_name\tkv_rank\tobject_group_id\tcache_salt"
        "\tobject_name\trequest_path\n"
    )
    for model, kv_rank, group, salt, h in CASES:
        key = ObjectKey(
            chunk_hash=h,
            model_name=model,
            kv_rank=kv_rank,
            object_group_id=group,
            cache_salt=salt,
        )
        name = _object_key_to_string(key)
        back = _string_to_object_key(name)
        if back != key:
            raise SystemExit(f"0.5.6 does not parse its own name back: {name!r}")
        path = _format_safe_path(name)
        out.write(f"{h.hex()}\t{model}\t{kv_rank}\t{group}\t{salt}\t{name}\t{path}\n")


if __name__ == "__main__":
    main()
