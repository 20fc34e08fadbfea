"""Golden per-object-group KV gathers/scatters (`--separate-object-groups`) made by
lmcache 0.5.6's own lmcache_driven transfer code, for checking kvshard's
per-object-group copy plans.

For each case it registers CPU KV tensors the way a CPU worker does (POSIX-shm
CpuShmTensorWrapper -> create_cache_context, i.e. CPUCacheContext, with lmcache's
EngineGroupInfo list, layout hint {"kv_layout": "NHD"}, separate_object_groups=True),
then runs, exactly as LMCacheDrivenTransferModule.store / .retrieve do:
  STORE:    all_null_chunk_masks(raw block ids, object_groups, blocks_per_chunk,
            num_chunks, null_block_id=0); downsample_and_stage_block_ids; then per
            object group og: memory objects (L1MemoryManager, MixedMemoryAllocator)
            with get_layout_desc(ctx, chunk_size, og) for the chunks not masked, and
            transfer_kv_per_object_group(object_group_id=og, batch_size=1,
            skip_first_n_tokens=0, D2H) with None for the masked chunks;
  RETRIEVE: into freshly registered all-zero tensors of the same shapes, other block
            ids: attn_desc = kv_layer_groups_manager.get_attn_desc(), group_skips =
            [0 if w < 0 else max(0, num_chunks - w) for w in
            attn_desc.num_chunks_in_sw], and per object group memory_objs =
            [None] * skip + the stored objects of chunks skip.., then
            transfer_kv_per_object_group(object_group_id=og,
            batch_size=ctx.max_batch_size, skip_first_n_tokens=S, H2D). A retrieve
            always covers all num_chunks chunks (tokens 0 .. num_chunks*chunk).
Inputs: byte i of registered tensor t = (i*31 + t*7 + 1) % 251 (t = registration
index), tight C-order strides, storage_offset 0; chunk size 16, NHD.

Object groups (lmcache's _detect_object_groups): kernel groups bucket by
(extra_object_group_tag, recurrent_state, window chunks), window chunks =
ceil(sw_size_tokens / chunk) (-1 for full attention), ordered by their first kernel
group. A sub-chunk window (sw < chunk) is therefore a 1-chunk window *and* is still
cut per chunk to its last sw/block_size blocks (as in golden_group_gather.json).
Each object group's memory object is its kernel groups' full-chunk regions
[kv, L, chunk, hidden] end to end; kernel_groups[g].object_offset is the region's
byte offset inside its own object group's object
(ctx.get_kernel_group_offset_in_object(og, g)). object_groups[og].window_chunks is
attn_desc.num_chunks_in_sw[og] (-1 = full attention).

Records per case: object groups, per object group the null masks and the bytes (hex)
and sha256 of every stored chunk object, and per retrieve the group_skips and the
sha256 of each destination tensor's whole storage (plus, per kernel group, the block
ids the retrieve left non-zero). Everything is rebuilt by hand (index_select /
reshape / concat on byte views; a window group's retrieve writes only the chunks
from its group skip on, and within those the skip_first_n_tokens rule per chunk of
make_group_golden.py) and asserted equal. Also asserted per case: the same
registration with separate_object_groups=False has one object group whose chunk
objects are the concatenation of the per-object-group objects (for the chunks
stored in every object group).

Sub-chunk window tails: as in make_group_golden.py, the region tail beyond the
kernel's compact [kv, L, transfer_slots, hidden] prefix is copied verbatim from the
context's temp buffer (torch.empty, undefined in 0.5.6); this script zeroes
ctx.tmp_cpu_buffer_ before each STORE, so the recorded tails are zeros. A poisoned
STORE (random temp buffer, objects pre-filled with 0x3C) checks that only those
tails change and that they equal the temp buffer's batch-slot-0 bytes at the kernel
group's temp-buffer offset (tmp_chunk_group_offsets_, kernel-group order).

Null chunks (case null_window_chunks): an object group whose raw block ids of a chunk
are all the null block 0 is masked: that chunk's object is not stored (the None
entry is skipped by the D2H); other object groups of the same chunk still are.

Helpers (tensor fill, hand_object, ...) come from make_group_golden.py beside this
file (imported; its main does not run).

Rerun from the repo root (writes golden_og_gather.json next to this file):
    ~/.cache/kvshard/lmcache-0.5.6/bin/python gds/tests/golden/make_og_golden.py
"""

# Standard
import hashlib
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Third Party
import torch  # noqa: E402

# First Party
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.distributed.config import L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.memory_manager.l1_memory_manager import (  # noqa: E402
    L1MemoryManager,
)
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (  # noqa: E402
    all_null_chunk_masks,
    get_layout_desc,
)
from lmcache.v1.multiprocess.object_group_transfer import (  # noqa: E402
    downsample_and_stage_block_ids,
    recalculate_blocks_to_skip,
    transfer_kv_per_object_group,
)
from lmcache.v1.platform.cache_context import create_cache_context  # noqa: E402
from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper  # noqa: E402
import lmcache.lmcache_native as native  # noqa: E402

# Local (beside this file)
from make_group_golden import (  # noqa: E402
    DT,
    DT_NAME,
    LAYOUT_HINT,
    byte_view,
    case_header,
    hand_object,
    kernel_group_record,
    make_infos,
    make_tensor,
    register,
    scatter_region,
    storage_bytes,
    tight_stride,
    written_blocks,
)

NULL_BLOCK_ID = 0


def sha(b):
    return hashlib.sha256(b).hexdigest()


def store(l1, ctx, chunk_size, num_chunks, store_ids, poison=None):
    """STORE exactly as LMCacheDrivenTransferModule.store_with_chunk_mask does.
    Returns (null masks, per og {chunk: memory obj}, staged host ids, object
    bytes per og). poison: None (zero the temp buffer) or a torch.Generator
    (random temp buffer, objects pre-filled with 0x3C)."""
    mgr = ctx.kv_layer_groups_manager
    n_og = mgr.num_object_groups
    bpcs = [ctx.calculate_num_blocks(chunk_size, g) for g in range(mgr.num_kernel_groups)]
    host_ids = [list(x) for x in store_ids]
    assert all(len(ids) >= num_chunks * b for ids, b in zip(host_ids, bpcs))
    masks = all_null_chunk_masks(
        host_ids, mgr.object_groups, bpcs, num_chunks, NULL_BLOCK_ID
    )
    staged = downsample_and_stage_block_ids(ctx, host_ids)  # cuts host_ids too
    if poison is None:
        ctx.tmp_cpu_buffer_.zero_()
    else:
        tmp = ctx.tmp_cpu_buffer_
        tmp.copy_(torch.randint(0, 256, tmp.shape, dtype=torch.uint8, generator=poison))
    stored, sizes = [], []
    for og in range(n_og):
        layout = get_layout_desc(ctx, chunk_size, object_group_id=og)
        want = [c for c in range(num_chunks) if not masks[og][c]]
        objs = []
        if want:
            err, objs = l1.allocate(layout, len(want))
            assert len(objs) == len(want), err
        by_chunk = dict(zip(want, objs))
        size = objs[0].get_size() if objs else None
        if poison is not None:
            for o in objs:
                o.raw_tensor[:size].fill_(0x3C)
        memory_objs = [by_chunk.get(c) for c in range(num_chunks)]
        transfer_kv_per_object_group(
            ctx,
            staged,
            memory_objs,
            object_group_id=og,
            batch_size=1,
            skip_first_n_tokens=0,
            direction=native.TransferDirection.D2H,
            transfer_key="golden-og-store",
            block_ids_host=host_ids,
        )
        stored.append(by_chunk)
        sizes.append(size)
    ctx.stream.synchronize()
    return masks, stored, host_ids, sizes


def obj_bytes(o):
    return o.raw_tensor[: o.get_size()].numpy().tobytes()


def hand_retrieve_og(specs, kgs, ogs, objects, ids, skip, chunk_size, num_chunks):
    """Scatter the per-object-group objects by hand into zero tensors. Object
    group og writes only chunks c >= its group skip; within a chunk c, kernel
    group g skips raw_skip = (skip_first_n_tokens - c*chunk) // block_size
    (clamped to [0, blocks_per_chunk]) raw blocks, and writes only its kept
    window (raw positions blocks_per_chunk-keep_blocks ..), read from the
    compact prefix of its region in the object, minus positions < raw_skip.
    Returns the storage sha256s and, per kernel group, the written block ids
    (in the order of the block ids)."""
    dst = [make_tensor(d, s, t, zero=True)[0] for t, (d, s) in enumerate(specs)]
    written_pos = [set() for _ in kgs]
    for og, ogd in enumerate(ogs):
        for c in range(ogd["group_skip"], num_chunks):
            obj = objects[og][c]
            assert len(obj) == ogd["object_bytes"]
            skip_in_chunk = max(0, skip - c * chunk_size)
            for g in ogd["kernel_group_indices"]:
                kg = kgs[g]
                at = kg["object_offset"]
                for pos in scatter_region(dst, kg, obj, at, ids[g], c, skip_in_chunk):
                    assert ids[g][pos] != NULL_BLOCK_ID, "would write the null block"
                    written_pos[g].add(pos)
    written = [[ids[g][p] for p in sorted(ps)] for g, ps in enumerate(written_pos)]
    return [sha(storage_bytes(x)) for x in dst], written


def run_case(l1, name, chunk_size, num_chunks, specs, groups, seed, skips,
             null_chunks=None):
    """specs: [(dtype, shape)] in registration order; groups: [(layer_indices,
    tokens_per_block[, sw_size_tokens])] in engine group order; skips: the
    RETRIEVE skip_first_n_tokens values; null_chunks: {kernel group: [chunk]}
    whose raw block ids (store and retrieve) are all the null block 0."""
    null_chunks = null_chunks or {}
    infos = make_infos(groups)
    tensors, ctx = register(specs, False, chunk_size, infos, separate=True)
    mgr = ctx.kv_layer_groups_manager
    attn_desc = mgr.get_attn_desc()
    n_og = mgr.num_object_groups
    assert attn_desc.num_object_groups == n_og
    assert list(attn_desc.group_kinds) == ["attention"] * n_og
    og_of = {}
    for og, info in enumerate(mgr.object_groups):
        assert not info.aux and not info.recurrent
        for g in info.kernel_group_indices:
            og_of[g] = og
    assert sorted(og_of) == list(range(mgr.num_kernel_groups))

    kgs = [
        kernel_group_record(ctx, chunk_size, g, og_of[g])
        for g in range(mgr.num_kernel_groups)
    ]

    ogs = []
    for og, info in enumerate(mgr.object_groups):
        members = list(info.kernel_group_indices)
        layout = get_layout_desc(ctx, chunk_size, object_group_id=og)
        w = attn_desc.num_chunks_in_sw[og]
        # the window lmcache derives: ceil(sw / chunk) of its kernel groups
        wants = {
            -1 if kgs[g]["sw_size_tokens"] == -1
            else -(-kgs[g]["sw_size_tokens"] // chunk_size)
            for g in members
        }
        assert wants == {w}, (name, og, wants, w)
        off = 0
        for g in members:
            assert kgs[g]["object_offset"] == off
            off += kgs[g]["region_bytes"]
        ogs.append(
            {
                "kernel_group_indices": members,
                "window_chunks": w,
                "object_bytes": off,
                "object_shape_dtype": [
                    [list(s), DT_NAME[d]] for s, d in zip(layout.shapes, layout.dtypes)
                ],
                "group_skip": 0 if w < 0 else max(0, num_chunks - w),
            }
        )

    bpcs = [kg["blocks_per_chunk"] for kg in kgs]
    nbs = [int(kg.shape_desc.nb) for kg in mgr.kernel_groups]
    rng = random.Random(seed)

    def draw():
        out = []
        for g, (nb, b) in enumerate(zip(nbs, bpcs)):
            ids = rng.sample(range(1, nb), num_chunks * b)
            for c in null_chunks.get(g, []):
                ids[c * b : (c + 1) * b] = [NULL_BLOCK_ID] * b
            out.append(ids)
        return out

    store_ids = draw()
    retr_ids = draw()

    # ---- STORE (D2H), as LMCacheDrivenTransferModule.store does ----
    tmp_nonzero = int((ctx.tmp_cpu_buffer_ != 0).sum())  # torch.empty: garbage
    masks, stored, staged_ids, sizes = store(l1, ctx, chunk_size, num_chunks, store_ids)
    for g, kg in enumerate(kgs):
        bpc, keep = kg["blocks_per_chunk"], kg["keep_blocks"]
        assert staged_ids[g] == [
            b for c in range(num_chunks)
            for b in store_ids[g][(c + 1) * bpc - keep : (c + 1) * bpc]
        ]
    objects = []  # per og {chunk: bytes}
    for og, ogd in enumerate(ogs):
        members = ogd["kernel_group_indices"]
        want_mask = [
            all(
                b == NULL_BLOCK_ID
                for g in members
                for b in store_ids[g][c * bpcs[g] : (c + 1) * bpcs[g]]
            )
            for c in range(num_chunks)
        ]
        assert masks[og] == want_mask, (name, og, masks[og])
        assert sorted(stored[og]) == [c for c in range(num_chunks) if not masks[og][c]]
        if stored[og]:
            assert sizes[og] == ogd["object_bytes"], (name, og, sizes[og])
        sub_kgs = [kgs[g] for g in members]
        sub_ids = [store_ids[g] for g in members]
        obs = {}
        for c, o in stored[og].items():
            b = obj_bytes(o)
            assert b == hand_object(tensors, sub_kgs, sub_ids, c), (name, og, c)
            obs[c] = b
        objects.append(obs)

    # ---- poisoned STORE: only the sub-chunk-window tails change ----
    _, pctx = register(specs, False, chunk_size, infos, separate=True)
    gen = torch.Generator().manual_seed(1000 + seed)
    _, pstored, _, _ = store(l1, pctx, chunk_size, num_chunks, store_ids, poison=gen)
    slot0 = pctx.tmp_cpu_buffer_[: pctx.tmp_chunk_bytes_].numpy().tobytes()
    tail_bytes = 0
    for og, ogd in enumerate(ogs):
        assert sorted(pstored[og]) == sorted(objects[og])
        for c, o in pstored[og].items():
            want = bytearray(objects[og][c])
            for g in ogd["kernel_group_indices"]:
                kg = kgs[g]
                a = kg["object_offset"] + kg["transfer_region_bytes"]
                b = kg["object_offset"] + kg["region_bytes"]
                t0 = pctx.tmp_chunk_group_offsets_[g] + kg["transfer_region_bytes"]
                want[a:b] = slot0[t0 : t0 + (b - a)]
                tail_bytes += b - a
            assert obj_bytes(o) == bytes(want), (name, "poisoned", og, c)
        l1.free(list(pstored[og].values()))
    pctx.close()

    # ---- sanity: the same registration without separation ----
    _, fctx = register(specs, False, chunk_size, infos, separate=False)
    fmgr = fctx.kv_layer_groups_manager
    assert fmgr.num_object_groups == 1, fmgr.object_groups
    assert fmgr.object_groups[0].kernel_group_indices == list(range(len(kgs)))
    assert fmgr.get_attn_desc().num_chunks_in_sw == [-1]
    order = [g for ogd in ogs for g in ogd["kernel_group_indices"]]
    _, fstored, _, _ = store(l1, fctx, chunk_size, num_chunks, store_ids)
    concat_checked = 0
    if order == list(range(len(kgs))):
        for c, o in fstored[0].items():
            if all(c in objects[og] for og in range(n_og)):
                assert obj_bytes(o) == b"".join(objects[og][c] for og in range(n_og))
                concat_checked += 1
    l1.free(list(fstored[0].values()))
    fctx.close()

    # ---- RETRIEVE (H2D) into zero tensors of a second registration ----
    group_skips = [
        0 if w < 0 else max(0, num_chunks - w) for w in attn_desc.num_chunks_in_sw
    ]
    assert group_skips == [ogd["group_skip"] for ogd in ogs]
    retrieves = []
    for skip in skips:
        assert 0 <= skip < num_chunks * chunk_size
        dst_tensors, ctx2 = register(specs, True, chunk_size, infos, separate=True)
        assert ctx2.kv_layer_groups_manager.get_attn_desc().num_chunks_in_sw == (
            attn_desc.num_chunks_in_sw
        )
        host_ids2 = [list(x) for x in retr_ids]
        staged2 = downsample_and_stage_block_ids(ctx2, host_ids2)
        for og in range(n_og):
            gs = group_skips[og]
            window_objs = [stored[og][c] for c in range(gs, num_chunks)]
            memory_objs = [None] * gs + window_objs
            transfer_kv_per_object_group(
                ctx2,
                staged2,
                memory_objs,
                object_group_id=og,
                batch_size=ctx2.max_batch_size,
                skip_first_n_tokens=skip,
                direction=native.TransferDirection.H2D,
                transfer_key="golden-og-retrieve",
                block_ids_host=host_ids2,
            )
        ctx2.stream.synchronize()
        paged = [sha(storage_bytes(x)) for x in dst_tensors]
        want_paged, want_written = hand_retrieve_og(
            specs, kgs, ogs, objects, retr_ids, skip, chunk_size, num_chunks
        )
        assert paged == want_paged, (name, skip)
        # written_blocks tests each listed id (null ids must stay zero)
        written = written_blocks(dst_tensors, kgs, retr_ids)
        written = [[b for b in w if b != NULL_BLOCK_ID] for w in written]
        for g in range(len(kgs)):
            for b in retr_ids[g]:
                if b == NULL_BLOCK_ID:
                    blk = byte_view(dst_tensors[kgs[g]["layers"][0]])
                    blk = blk[:, b] if blk.dim() == 5 else blk[b]
                    assert not blk.any(), (name, skip, "null block written")
        assert written == want_written, (name, skip, written, want_written)
        retrieves.append(
            {
                "skip_first_n_tokens": skip,
                "block_ids": retr_ids,
                "batch_size": ctx2.max_batch_size,
                "group_skips": group_skips,
                "paged_sha256": paged,
                "written_block_ids": written,
            }
        )
        ctx2.close()
    for og in range(n_og):
        l1.free(list(stored[og].values()))
    ctx.close()

    case = case_header(name, chunk_size, num_chunks, specs, infos)
    case.update({
        "kernel_groups": kgs,
        "object_groups": [
            {k: v for k, v in ogd.items() if k != "group_skip"} for ogd in ogs
        ],
        "store": {
            "batch_size": 1,
            "block_ids": store_ids,
            "null_masks": masks,
            "objects": [
                [
                    {"chunk": c, "hex": objects[og][c].hex(),
                     "sha256": sha(objects[og][c])}
                    for c in sorted(objects[og])
                ]
                for og in range(n_og)
            ],
        },
        "retrieves": retrieves,
    })
    if any(kg["keep_blocks"] != kg["blocks_per_chunk"] for kg in kgs):
        case["store"]["staged_block_ids"] = staged_ids
    print(
        name, "| temp buffer bytes non-zero at creation:", tmp_nonzero, "of",
        ctx.tmp_cpu_buffer_.numel(), "| poisoned tail bytes:", tail_bytes,
        "| non-separated objects checked as concatenation:", concat_checked,
    )
    return case


def main():
    l1 = L1MemoryManager(
        L1MemoryManagerConfig(size_in_bytes=4 << 20, use_lazy=False, shm_name="")
    )
    f16, bf16 = "float16", "bfloat16"
    C = 16
    skips = [0, 5, C + 5, 2 * C + 5, 3 * C + 13]
    cases = [
        # full (2 layers, 2x16) | sw 32 = 2 chunks (1 layer, 1x16)
        # | sub-chunk sw 8 (1 layer, 2x8): 1-chunk window, last 2 of 4 blocks
        run_case(
            l1, "three_object_groups", C, 4,
            [(f16, (2, 20, 4, 2, 16)), (f16, (2, 20, 4, 2, 16)),
             (f16, (2, 20, 4, 1, 16)), (f16, (2, 20, 4, 2, 8))],
            [([0, 1], 4), ([2], 4, 32), ([3], 4, 8)], seed=11, skips=skips,
        ),
        # full | sw 24 bf16 MLA + sw 32 f16 classical: both 2-chunk windows,
        # so one object group holds both
        run_case(
            l1, "two_windowed_groups_share_one", C, 4,
            [(f16, (2, 20, 4, 2, 16)), (f16, (2, 20, 4, 2, 16)),
             (bf16, (20, 4, 36)), (f16, (2, 20, 4, 1, 16))],
            [([0, 1], 4), ([2], 4, 24), ([3], 4, 32)], seed=12, skips=skips,
        ),
        # full | sw 32 whose first two chunks are all null block 0
        run_case(
            l1, "null_window_chunks", C, 4,
            [(f16, (2, 20, 4, 2, 16)), (f16, (2, 20, 4, 2, 16)),
             (f16, (2, 20, 4, 1, 16))],
            [([0, 1], 4), ([2], 4, 32)], seed=13, skips=skips,
            null_chunks={1: [0, 1]},
        ),
    ]
    out = {
        "lmcache_version": "0.5.6",
        "fill": "byte i of tensor t = (i*31 + t*7 + 1) % 251",
        "separate_object_groups": True,
        "null_block_id": NULL_BLOCK_ID,
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "golden_og_gather.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for c in cases:
        print(c["name"])
        for og, o in enumerate(c["object_groups"]):
            print("  og", og, "kernel groups", o["kernel_group_indices"],
                  "window_chunks", o["window_chunks"], "object_bytes",
                  o["object_bytes"], "stored chunks",
                  [x["chunk"] for x in c["store"]["objects"][og]],
                  "null mask", c["store"]["null_masks"][og])
        for r in c["retrieves"]:
            print("  retrieve skip", r["skip_first_n_tokens"], "group_skips",
                  r["group_skips"], "written per kg",
                  [len(w) for w in r["written_block_ids"]])
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
