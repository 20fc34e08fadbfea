"""Stores requests through the real lmcache 0.5.6 bench client with sliding-window
KV groups under `--separate-object-groups`, or loads them back after a server
restart, and checks per KV block which bytes came back.

  python og_interop.py store FILE [--sw-size-tokens W0,W1,...] [bench flags...]
      lookup (must miss), STORE the whole request; saves the sha256 of every
      block of every registered KV tensor (per worker rank) to FILE.
  python og_interop.py load FILE [--sw-size-tokens ...] [--expect-hit N] [bench flags...]
      zeroes every KV tensor, lookup (must hit every chunk, or exactly N with
      --expect-hit), RETRIEVE the hit prefix, then checks each block against FILE.

--sw-size-tokens gives one sliding window per group of --kvcache-shape-spec, in
tokens (-1 = full attention; default: all -1). The bench registers its groups as
EngineGroupInfo(engine_group_id, layer_indices, tokens_per_block) without a
window, so the script wraps lmcache.v1.multiprocess.group_view.EngineGroupInfo
(which the bench imports inside ServerBenchClient._initialize) while the client
starts, filling sw_size_tokens by engine_group_id.

What a RETRIEVE of a prefix of H chunks must write, as lmcache 0.5.6 does it
(kv_layer_groups.py, object_group_transfer.py, lmcache_driven_transfer.py):
  full attention (-1)   every block of chunks [0, H);
  window sw >= chunk    every block of the last ceil(sw / chunk) chunks;
  window sw < chunk     the last sw / block_size blocks of the last chunk (a
                        sub-chunk window rounds up to a window of one chunk and
                        each object holds only each chunk's last sw tokens);
and every other block of the request stays zero.

The other flags are `lmcache bench server`'s own (--mode cpu --transfer-mode
lmcache_driven --rpc-url --url --num-tokens --kvcache-shape-spec --start --end
...), parsed by its own parser; the script's flags are taken out first.
"""

import argparse
import hashlib
import json
import sys

import torch
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.command import add_server_arguments
from lmcache.cli.commands.bench.server_bench.config import parse_args_to_config

USAGE = (
    "usage: og_interop.py store|load FILE [--sw-size-tokens W0,W1,...] "
    "[--expect-hit N] [lmcache bench server flags...]"
)


def fail_usage(msg: str) -> None:
    print(f"og_interop: {msg}\n{USAGE}", file=sys.stderr)
    sys.exit(2)


def take_own_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """Takes --sw-size-tokens and --expect-hit out of argv (by hand: argparse
    would read "-1,512" as a flag), returns them and the rest in order."""
    own: dict = {"sw": None, "expect_hit": None}
    names = {"--sw-size-tokens": "sw", "--expect-hit": "expect_hit"}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq:
                if i + 1 >= len(argv):
                    fail_usage(f"{flag} needs a value")
                i += 1
                value = argv[i]
            own[names[flag]] = value
        else:
            rest.append(arg)
        i += 1
    if own["expect_hit"] is not None:
        try:
            own["expect_hit"] = int(own["expect_hit"])
        except ValueError:
            fail_usage(f"--expect-hit wants an integer, got {own['expect_hit']!r}")
        if own["expect_hit"] < 0:
            fail_usage("--expect-hit must be >= 0")
    return own, rest


def parse_windows(text: str | None, num_groups: int) -> list[int]:
    if text is None:
        return [-1] * num_groups
    try:
        windows = [int(v) for v in text.split(",")]
    except ValueError:
        fail_usage(f"--sw-size-tokens wants comma-separated integers, got {text!r}")
    if len(windows) != num_groups:
        fail_usage(
            f"--sw-size-tokens has {len(windows)} values but the shape spec has "
            f"{num_groups} groups"
        )
    if any(w == 0 or w < -1 for w in windows):
        fail_usage(f"each window must be -1 or > 0 tokens, got {windows}")
    return windows


def install_windows(windows: list[int]):
    """Wraps group_view.EngineGroupInfo so that the bench's registration carries
    sw_size_tokens; returns (restore, calls)."""
    # Import, before the swap, every module that binds EngineGroupInfo at import
    # time and that the client imports lazily, so they keep the real class.
    import lmcache.v1.kv_layer_groups  # noqa: F401
    import lmcache.v1.multiprocess.transfer_context  # noqa: F401
    import lmcache.v1.multiprocess.transport.factory  # noqa: F401
    import lmcache.v1.multiprocess.group_view as group_view

    real = group_view.EngineGroupInfo
    calls: list[int] = []

    def with_window(*args, **kwargs):
        group_id = kwargs["engine_group_id"] if "engine_group_id" in kwargs else args[0]
        kwargs.setdefault("sw_size_tokens", windows[group_id])
        calls.append(group_id)
        return real(*args, **kwargs)

    group_view.EngineGroupInfo = with_window

    def restore() -> None:
        group_view.EngineGroupInfo = real

    return restore, calls


def block_dim(t) -> int:
    # As the bench: rank-3 MLA tensors (NB, BS, hidden), rank-5 (kv, NB, BS, NH, HS).
    return 0 if t.dim() == 3 else 1


def block_bytes(t, block: int):
    return t.narrow(block_dim(t), block, 1).contiguous().view(-1).view(torch.uint8)


def block_sha(t, block: int) -> str:
    return hashlib.sha256(block_bytes(t, block).numpy().tobytes()).hexdigest()


def expected_blocks(sw: int, hit: int, chunk: int, block_size: int) -> set[int]:
    """Request-relative blocks a RETRIEVE of `hit` chunks writes for a group."""
    bpc = chunk // block_size
    if hit <= 0:
        return set()
    if sw == -1:
        window_chunks, keep = hit, bpc
    else:
        window_chunks = -(-sw // chunk)
        keep = min(sw, chunk) // block_size
    lo = max(0, hit - window_chunks)
    return {c * bpc + j for c in range(lo, hit) for j in range(bpc - keep, bpc)}


def describe(sw: int, chunk: int) -> str:
    if sw == -1:
        return "full"
    if sw >= chunk:
        return f"window {sw} tokens = {-(-sw // chunk)} chunks"
    return f"window {sw} tokens (sub-chunk)"


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("store", "load"):
        fail_usage("need a phase (store|load) and a FILE")
    phase, path = sys.argv[1], sys.argv[2]
    own, rest = take_own_flags(sys.argv[3:])
    if phase == "store" and own["expect_hit"] is not None:
        fail_usage("--expect-hit is for load")

    parser = argparse.ArgumentParser(prog="og_interop.py")
    add_server_arguments(parser)
    args = parser.parse_args(rest)
    if args.end is None:
        args.end = args.start + 1

    from lmcache.v1.kv_layer_groups import parse_kvcache_shape_spec

    groups = parse_kvcache_shape_spec(args.kvcache_shape_spec)
    windows = parse_windows(own["sw"], len(groups))
    group_of_layer = {
        f"layer.{i}": g for g, group in enumerate(groups) for i in group.layer_indices
    }

    saved: dict = {}
    if phase == "load":
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            print(f"og_interop: cannot read the store's checksums: {e}", file=sys.stderr)
            return 1
        for field, mine in (("spec", args.kvcache_shape_spec), ("windows", windows)):
            if saved.get(field) != mine:
                print(
                    f"og_interop: load {field} {mine} differs from the store's "
                    f"{saved.get(field)}",
                    file=sys.stderr,
                )
                return 1

    client = ServerBenchClient(parse_args_to_config(args), lambda m: None)
    restore, calls = install_windows(windows)
    try:
        client.start()
    except Exception as e:
        print(f"og_interop: the bench client did not start: {e!r}", file=sys.stderr)
        return 1
    finally:
        restore()
    if sorted(calls) != list(range(len(groups))):
        client.close()
        print(
            f"og_interop: the bench built EngineGroupInfo for groups {calls}, "
            f"expected {list(range(len(groups)))}: the window patch did not apply",
            file=sys.stderr,
        )
        return 1
    chunk, block_size = client._chunk_size, client._block_size
    workers = client._workers
    for g, sw in enumerate(windows):
        if 0 < sw < chunk and sw % block_size:
            client.close()
            print(
                f"og_interop: group {g}: a sub-chunk window ({sw}) must be whole "
                f"blocks of {block_size}",
                file=sys.stderr,
            )
            return 1

    failures: list[str] = []
    failed_seqs: set[int] = set()
    requests: dict = saved.get("requests", {})
    # per group: blocks checked equal to the stored ones / checked zero
    matched = [0] * len(groups)
    zeroed = [0] * len(groups)
    hits: list[int] = []

    def bad(seq: int, msg: str) -> None:
        failures.append(f"seq {seq}: {msg}")
        failed_seqs.add(seq)

    if phase == "load":
        for w in workers:
            for t in w.kv_caches.values():
                t.zero_()
    try:
        for seq in range(args.start, args.end):
            req = client.create_request(seq, f"og-{phase}-{seq}", phase)
            if req is None:
                bad(seq, f"fewer than {chunk} tokens: no full chunk")
                continue
            look = client.lookup(req)
            if not look.succeeded:
                bad(seq, f"lookup failed ({look.error})")
                client.end_session(req)
                continue
            hits.append(look.hit_chunks)
            n = req.num_full_tokens
            first, count = req.block_offset, req.num_blocks
            if phase == "store":
                if look.hit_chunks != 0:
                    bad(seq, f"expected a cold miss, hit {look.hit_chunks}")
                res = client.store(req, start_token=0, token_count=n)
                if res is None or not res.succeeded:
                    bad(seq, "store failed")
                requests[str(seq)] = {
                    "block_offset": first,
                    "num_blocks": count,
                    "total_chunks": req.total_chunks,
                    "ranks": {
                        str(w.spec.rank): {
                            name: [block_sha(t, first + b) for b in range(count)]
                            for name, t in w.kv_caches.items()
                        }
                        for w in workers
                    },
                }
                client.end_session(req)
                continue

            want = req.total_chunks if own["expect_hit"] is None else own["expect_hit"]
            rec = requests.get(str(seq))
            if rec is None:
                bad(seq, f"not in {path}")
                client.end_session(req)
                continue
            if (rec["block_offset"], rec["num_blocks"]) != (first, count):
                bad(seq, f"blocks {first}+{count} differ from the store's "
                    f"{rec['block_offset']}+{rec['num_blocks']}")
                client.end_session(req)
                continue
            if look.hit_chunks != want:
                bad(seq, f"expected {want} of {req.total_chunks} chunks to hit, "
                    f"hit {look.hit_chunks}")
                client.end_session(req)
                continue
            # Requests may share blocks: zero this one's before it retrieves.
            for w in workers:
                for t in w.kv_caches.values():
                    t.narrow(block_dim(t), first, count).zero_()
            hit = look.hit_chunks
            if hit > 0:
                res = client.retrieve(req, start_token=0, token_count=hit * chunk)
                if res is None or not res.succeeded:
                    bad(seq, f"retrieve of {hit} chunks failed")
            want_blocks = [expected_blocks(sw, hit, chunk, block_size) for sw in windows]
            wrong: list[str] = []
            for w in workers:
                if not w.spec.retrieve_enabled:
                    continue
                sums = rec["ranks"].get(str(w.spec.rank))
                if sums is None:
                    bad(seq, f"rank {w.spec.rank} not in {path}")
                    continue
                for name, t in w.kv_caches.items():
                    g = group_of_layer[name]
                    for b in range(count):
                        if b in want_blocks[g]:
                            if block_sha(t, first + b) == sums[name][b]:
                                matched[g] += 1
                            else:
                                wrong.append(f"rank {w.spec.rank} {name} block {b}: "
                                             "differs from the stored bytes")
                        elif block_bytes(t, first + b).any():
                            wrong.append(f"rank {w.spec.rank} {name} block {b}: "
                                         "written, should have stayed zero")
                        else:
                            zeroed[g] += 1
            if wrong:
                bad(seq, f"{len(wrong)} blocks wrong, first: " + "; ".join(wrong[:4]))
            client.end_session(req)
    finally:
        client.close()

    if phase == "store":
        with open(path, "w") as f:
            json.dump(
                {
                    "spec": args.kvcache_shape_spec,
                    "windows": windows,
                    "chunk_size": chunk,
                    "block_size": block_size,
                    "requests": requests,
                },
                f,
            )
    total = args.end - args.start
    for line in failures:
        print(f"  {line}")
    groups_text = ", ".join(
        f"group {g} ({describe(sw, chunk)})" for g, sw in enumerate(windows)
    )
    summary = (
        f"{phase}: {total - len(failed_seqs)}/{total} requests ok; chunk {chunk}, "
        f"block {block_size}; {groups_text}; lookup hits {hits}"
    )
    if phase == "load":
        summary += "; blocks matched/zero per group " + ", ".join(
            f"{matched[g]}/{zeroed[g]}" for g in range(len(groups))
        )
    print(summary)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
