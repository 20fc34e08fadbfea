"""Stores requests through the real lmcache 0.5.6 bench client, or loads them back
after a server restart, and checks the bytes by checksum.

  python l2_restart.py store FILE [lmcache bench server flags...]
      lookup (must miss), checksum the client's KV blocks, STORE; saves the
      checksums to FILE.
  python l2_restart.py load FILE [same flags]
      lookup (must hit every chunk), RETRIEVE into fresh buffers, checksum;
      compares with FILE.

The flags are `lmcache bench server`'s own (--rpc-url, --url, --transfer-mode,
--num-tokens, --start, --end, ...), parsed by its own parser.
"""

import argparse
import json
import sys

from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.command import add_server_arguments
from lmcache.cli.commands.bench.server_bench.config import parse_args_to_config


def main() -> int:
    phase, path, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(rest)
    client = ServerBenchClient(parse_args_to_config(args), lambda m: None)
    client.start()
    failures = []
    saved = {}
    if phase == "load":
        with open(path) as f:
            saved = json.load(f)
    try:
        for seq in range(args.start, args.end):
            req = client.create_request(seq, f"l2-{phase}-{seq}", phase)
            look = client.lookup(req)
            if not look.succeeded:
                failures.append(f"seq {seq}: lookup failed ({look.error})")
                continue
            n = req.num_full_tokens
            if phase == "store":
                if look.hit_chunks != 0:
                    failures.append(f"seq {seq}: expected a cold miss, hit {look.hit_chunks}")
                sums = client.compute_checksums(req, start_token=0, token_count=n)
                res = client.store(req, start_token=0, token_count=n)
                if res is None or not res.succeeded:
                    failures.append(f"seq {seq}: store failed")
                saved[str(seq)] = sums
            else:
                if look.hit_chunks != req.total_chunks:
                    failures.append(
                        f"seq {seq}: expected {req.total_chunks} chunks from L2, hit {look.hit_chunks}"
                    )
                    client.end_session(req)
                    continue
                client.zero_destination(req, start_token=0, token_count=n)
                res = client.retrieve(req, start_token=0, token_count=n)
                if res is None or not res.succeeded:
                    failures.append(f"seq {seq}: retrieve failed")
                sums = client.compute_checksums(req, start_token=0, token_count=n)
                if not sums or sums != saved.get(str(seq)):
                    failures.append(f"seq {seq}: checksum mismatch")
            client.end_session(req)
    finally:
        client.close()
    if phase == "store":
        with open(path, "w") as f:
            json.dump(saved, f)
    count = args.end - args.start
    for f in failures:
        print(f"  {f}")
    print(f"{phase}: {count - len({f.split(':')[0] for f in failures})}/{count} requests ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
