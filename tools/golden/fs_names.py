"""Prints lmcache 0.5.6's fs-adapter file names for a set of object keys.

Run with the lmcache 0.5.6 virtualenv:

    ~/.cache/kvshard/lmcache-0.5.6/bin/python tools/golden/fs_names.py \
        > engine/tests/data/l2_golden_names.txt

Each name is computed by 0.5.6's own code (``_object_key_to_filename`` on a
real ``ObjectKey``), and checked to parse back through 0.5.6's
``_filename_to_object_key``, so the Rust naming can be compared with it.

Output: '#' comment lines, then one line per key with tab-separated fields
    chunk_hash_hex  model_name  kv_rank(decimal)  object_group_id  cache_salt  file_name
(cache_salt may be empty).
"""

# Standard
import hashlib
import logging
import sys

logging.disable(logging.CRITICAL)

# First Party
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (  # noqa: E402
    _filename_to_object_key,
    _object_key_to_filename,
)


def chunk_hash(i: int) -> bytes:
    return hashlib.sha256(f"kvshard-golden-{i}".encode()).digest()


# (model_name, kv_rank, object_group_id, cache_salt, chunk hash)
CASES = [
    ("org/test-model", 0, 0, "", chunk_hash(0)),
    ("org/test-model", 1, 0, "", chunk_hash(1)),
    ("meta-llama/Llama-3.1-8B-Instruct", 0x00020001, 0, "", chunk_hash(2)),
    ("meta-llama/Llama-3.1-8B-Instruct", 0x01000100, 3, "", chunk_hash(3)),
    ("Qwen/Qwen2.5-7B", 0x04020402, 3, "tenant-a", chunk_hash(4)),
    ("gpt2", 0x01000100, 0, "user_42", chunk_hash(5)),
    ("org/sub/deep-model", 0x08070403, 0x1F, "", chunk_hash(6)),
    ("model_with.dots-and_underscores", 0xFFFFFFFF, 0, "s", chunk_hash(7)),
    ("org/model-7B", 0x01000100, 0, "salt.with.dots-and-dashes", chunk_hash(8)),
    ("org/model-7B", 0x01000100, 3, "", bytes(32)),
    ("org/model-7B", 0, 0, "", bytes([0xFF]) * 32),
    ("/leading-slash", 0x02010201, 1, "x" * 128, chunk_hash(11)),
]


def main() -> None:
    out = sys.stdout
    out.write("# lmcache 0.5.6 fs L2 adapter file names (tools/golden/fs_names.py)\n")
    out.write(
        "# chunk_hash_hex\tmodel_name\tkv_rank\tobject_group_id\tcache_salt\tfile_name\n"
    )
    for model, kv_rank, group, salt, h in CASES:
        key = ObjectKey(
            chunk_hash=h,
            model_name=model,
            kv_rank=kv_rank,
            object_group_id=group,
            cache_salt=salt,
        )
        name = _object_key_to_filename(key)
        back = _filename_to_object_key(name)
        if back != key:
            raise SystemExit(f"0.5.6 does not parse its own name back: {name!r}")
        out.write(f"{h.hex()}\t{model}\t{kv_rank}\t{group}\t{salt}\t{name}\n")


if __name__ == "__main__":
    main()
