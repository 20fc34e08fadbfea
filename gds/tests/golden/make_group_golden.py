"""Golden multi-group (hybrid) KV gathers/scatters made by lmcache 0.5.6's own
lmcache_driven transfer code, for checking kvshard's per-kernel-group copy plans.

For each case it registers CPU KV tensors the way a CPU worker does (POSIX-shm
CpuShmTensorWrapper -> create_cache_context, i.e. CPUCacheContext, with lmcache's
EngineGroupInfo list, layout hint {"kv_layout": "NHD"}, separate_object_groups=False),
then runs, exactly as LMCacheDrivenTransferModule does:
  STORE:    downsample_and_stage_block_ids + transfer_kv_per_object_group(
            object_group_id=0, batch_size=1, skip_first_n_tokens=0, D2H)
            into memory objects allocated by L1MemoryManager (MixedMemoryAllocator)
            with get_layout_desc(ctx, chunk_size, 0);
  RETRIEVE: the same objects into freshly registered all-zero tensors of the same
            shapes, other block ids, batch_size=ctx.max_batch_size,
            skip_first_n_tokens = one block + 1 token of the largest block size, H2D.
Inputs: byte i of registered tensor t = (i*31 + t*7 + 1) % 251 (t = registration
index), tight C-order strides, storage_offset 0.
Records per chunk object the bytes (hex) and sha256, and per destination tensor the
sha256 of its whole storage after the retrieve. Every case is also rebuilt by hand
(index_select / reshape / concat on byte views) and asserted equal.

Sub-chunk sliding windows (cases f..h): an EngineGroupInfo with sw_size_tokens < chunk
size keeps, per chunk, only the last keep_blocks = (sw_size_tokens // block_size) of the
chunk's raw block ids (downsample_and_stage_block_ids cuts the RAW lists recorded under
store.block_ids; store.staged_block_ids is what it leaves). The object region of such a
group keeps get_layout_desc's full-chunk shape [kv, L, chunk, hidden], but the kernel
moves only a compact [kv, L, transfer_slots, hidden] prefix of it (transfer_slots =
get_slots_per_chunk_in_sw = keep_blocks * block_size; kernel group field
transfer_region_bytes). The rest of the region is never written by the kernel: on STORE
it is copied verbatim from the context's temp buffer (CPUCacheContext.tmp_cpu_buffer_,
torch.empty, i.e. uninitialised heap memory), so in 0.5.6 it is undefined. This script
zeroes the temp buffer before each STORE, so the recorded tails are zero; a second,
poisoned STORE (random temp buffer, objects pre-filled with 0x3C) checks that nothing
else changes and that every tail equals the temp buffer's batch-slot-0 bytes at the same
offsets (the same for every chunk). RETRIEVE reads only the prefix. sw_size_tokens >=
chunk size has no effect (case h is checked equal, byte for byte, to the same case with
sw_size_tokens = -1).
`retrieves` (every case) holds one record per skip_first_n_tokens value, each with the
per-kernel-group written_block_ids (block ids of the destination left non-zero, in the
order of block_ids); `retrieve` is the first of them, without written_block_ids.
`sw_size_checks` records which sliding-window sizes 0.5.6 refuses, and where.

Rerun from the repo root (writes golden_group_gather.json next to this file):
    ~/.cache/kvshard/lmcache-0.5.6/bin/python gds/tests/golden/make_group_golden.py
"""

# Standard
import hashlib
import json
import math
import os
import random

# Third Party
import torch

torch.set_num_threads(1)

# First Party
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.distributed.config import L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.memory_manager.l1_memory_manager import (  # noqa: E402
    L1MemoryManager,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: E402
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (  # noqa: E402
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

LAYOUT_HINT = "NHD"  # what `lmcache bench` sends; CPU detection defaults to HND
DT = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
DT_NAME = {v: k for k, v in DT.items()}


def tight_stride(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return list(reversed(st))


def make_tensor(dtype_name, shape, t, zero=False):
    dtype = DT[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if zero:
        raw = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        i = torch.arange(nbytes, dtype=torch.int64)
        raw = ((i * 31 + t * 7 + 1) % 251).to(torch.uint8)
    return raw.view(dtype).as_strided(shape, tight_stride(shape), 0), nbytes


def storage_bytes(tensor):
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(tensor.untyped_storage())
    return flat.numpy().tobytes()


def register(specs, zero, chunk_size, infos, separate=False):
    """Client side: shm-wrap each tensor; server side: create_cache_context
    (`separate`: 0.5.6's --separate-object-groups)."""
    tensors, wrappers = [], []
    for t, (dtype_name, shape) in enumerate(specs):
        x, _ = make_tensor(dtype_name, shape, t, zero)
        w = CpuShmTensorWrapper.wrap(x)  # migrates x onto a POSIX shm segment
        tensors.append(x)
        # what the server decodes from REGISTER_KV_CACHE (descriptor only)
        wrappers.append(CpuShmTensorWrapper.from_wire(w.to_wire()))
    ctx = create_cache_context(
        wrappers,
        chunk_size,
        layout_hints={"kv_layout": LAYOUT_HINT},
        engine_group_infos=infos,
        engine_type=EngineType.VLLM,
        separate_object_groups=separate,
        full_sw_kv=False,
    )
    return tensors, ctx


def byte_view(x):
    """uint8 view with the last dim scaled by itemsize (bit-exact)."""
    return x.view(torch.uint8)


def hand_object(tensors, kgs, ids, c):
    """Rebuild chunk c by hand: per kernel group the chunk's kept blocks (the
    last keep_blocks of its raw ids; all of them without a sub-chunk window) as
    a compact [kv, L, transfer_slots, hidden] prefix, zero-padded to the
    group's full-chunk region [kv, L, chunk, hidden]."""
    parts = []
    for g, kg in enumerate(kgs):
        bpc, keep = kg["blocks_per_chunk"], kg["keep_blocks"]
        sel = torch.tensor(
            ids[g][(c + 1) * bpc - keep : (c + 1) * bpc], dtype=torch.long
        )
        per_layer = []
        for layer in kg["layers"]:
            b = byte_view(tensors[layer])
            if b.dim() == 5:  # (2, NB, BS, NH, HS*isz), NHD
                blk = b.index_select(1, sel)
                per_layer.append(blk.reshape(2, -1, b.shape[3] * b.shape[4]))
            else:  # MLA (NB, BS, HS*isz)
                blk = b.index_select(0, sel)
                per_layer.append(blk.reshape(1, -1, b.shape[2]))
        prefix = torch.stack(per_layer, dim=1).contiguous().numpy().tobytes()
        assert len(prefix) == kg["transfer_region_bytes"], (kg, len(prefix))
        parts.append(prefix + bytes(kg["region_bytes"] - len(prefix)))
    return b"".join(parts)


def scatter_region(dst, kg, obj, off, ids, c, skip_in_chunk):
    """Scatter kernel group kg's region of chunk c's object (at byte off) by
    hand into the tensors dst: raw_skip = skip_in_chunk // block_size (clamped
    to [0, blocks_per_chunk]) raw blocks of the chunk are skipped; only the
    kept window (raw positions blocks_per_chunk-keep_blocks ..) is ever
    written, read from the compact prefix of the region, minus those
    positions < raw_skip. ids: the group's block ids. Returns the positions
    in ids written."""
    bpc, keep, bs = kg["blocks_per_chunk"], kg["keep_blocks"], kg["block_size"]
    shape = kg["object_shape"]
    isz = DT[kg["object_dtype"]].itemsize
    m = kg["transfer_region_bytes"]
    region = torch.frombuffer(bytearray(obj[off : off + m]), dtype=torch.uint8)
    region = region.view(shape[0], shape[1], kg["transfer_slots"], shape[3] * isz)
    raw_skip = min(bpc, skip_in_chunk // bs)
    kept_skipped = sum(1 for p in range(bpc - keep, bpc) if p < raw_skip)
    # lmcache's own rule, applied to this chunk alone
    assert kept_skipped == recalculate_blocks_to_skip(bpc, keep, raw_skip)
    written = []
    for k in range(keep):
        p = bpc - keep + k
        if p < raw_skip:
            continue
        bid = ids[c * bpc + p]
        written.append(c * bpc + p)
        for li, layer in enumerate(kg["layers"]):
            d = byte_view(dst[layer])
            piece = region[:, li, k * bs : (k + 1) * bs]
            if d.dim() == 5:
                d[:, bid] = piece.reshape(2, bs, d.shape[3], d.shape[4])
            else:
                d[bid] = piece.reshape(bs, d.shape[2])
    return written


def hand_retrieve(specs, kgs, objects, ids, skip, chunk_size):
    """Scatter the objects by hand into zero tensors, every kernel group's
    region of each chunk (scatter_region). Returns the storage sha256s and,
    per kernel group, the written block ids."""
    dst = [make_tensor(d, s, t, zero=True)[0] for t, (d, s) in enumerate(specs)]
    written = [[] for _ in kgs]
    for c, obj in enumerate(objects):
        off = 0
        skip_in_chunk = max(0, skip - c * chunk_size)
        for g, kg in enumerate(kgs):
            for pos in scatter_region(dst, kg, obj, off, ids[g], c, skip_in_chunk):
                written[g].append(ids[g][pos])
            off += kg["region_bytes"]
        assert off == len(obj)
    return [hashlib.sha256(storage_bytes(x)).hexdigest() for x in dst], written


def written_blocks(dst_tensors, kgs, ids):
    """Per kernel group, the block ids (in list order) that the retrieve left
    non-zero; every layer of the group must agree."""
    out = []
    for g, kg in enumerate(kgs):
        got = []
        for bid in ids[g]:
            flags = set()
            for layer in kg["layers"]:
                b = byte_view(dst_tensors[layer])
                blk = b[:, bid] if b.dim() == 5 else b[bid]
                flags.add(bool(blk.any()))
            assert len(flags) == 1, (g, bid, flags)
            if flags.pop():
                got.append(bid)
        out.append(got)
    return out


def make_infos(groups):
    """groups: [(layer_indices, tokens_per_block[, sw_size_tokens])]."""
    return [
        EngineGroupInfo(
            engine_group_id=gid,
            layer_indices=tuple(grp[0]),
            tokens_per_block=grp[1],
            sw_size_tokens=grp[2] if len(grp) > 2 else -1,
            extra_object_group_tag=0,
            recurrent_state=False,
        )
        for gid, grp in enumerate(groups)
    ]


def store(ctx, objs, store_ids):
    """STORE (D2H) exactly as LMCacheDrivenTransferModule.store does; returns
    the staged (downsampled) host block ids."""
    host_ids = [list(x) for x in store_ids]
    staged = downsample_and_stage_block_ids(ctx, host_ids)  # cuts host_ids too
    transfer_kv_per_object_group(
        ctx,
        staged,
        objs,
        object_group_id=0,
        batch_size=1,
        skip_first_n_tokens=0,
        direction=native.TransferDirection.D2H,
        transfer_key="golden-store",
        block_ids_host=host_ids,
    )
    ctx.stream.synchronize()
    return host_ids


def check_poisoned_store(l1, specs, infos, chunk_size, layout, store_ids, objects,
                         kgs, seed):
    """STORE again with a random temp buffer and 0x3C-filled objects: every
    byte of each object must match the golden one except the tail of each
    sliding-window region ([transfer_region_bytes, region_bytes) of the group),
    which must equal the temp buffer's batch-slot-0 bytes at the same offset
    (so: the same for every chunk, and never another chunk's or group's KV).
    Returns the number of such tail bytes per object."""
    _, ctx = register(specs, False, chunk_size, infos)
    tmp = ctx.tmp_cpu_buffer_
    for g, kg in enumerate(kgs):
        assert ctx.tmp_chunk_group_offsets_[g] == kg["object_offset"]
    gen = torch.Generator().manual_seed(1000 + seed)
    tmp.copy_(torch.randint(0, 256, tmp.shape, dtype=torch.uint8, generator=gen))
    slot0 = tmp[: ctx.get_temp_object_group_buffer(0, 0).numel()].numpy().tobytes()
    err, objs = l1.allocate(layout, len(objects))
    assert len(objs) == len(objects), err
    size = objs[0].get_size()
    for o in objs:
        o.raw_tensor[:size].fill_(0x3C)
    store(ctx, objs, store_ids)
    tail_bytes = 0
    for c, ob in enumerate(objects):
        want = bytearray(ob)
        for kg in kgs:
            a = kg["object_offset"] + kg["transfer_region_bytes"]
            b = kg["object_offset"] + kg["region_bytes"]
            want[a:b] = slot0[a:b]
            tail_bytes += (b - a) if c == 0 else 0
        assert objs[c].raw_tensor[:size].numpy().tobytes() == bytes(want), c
    l1.free(objs)
    ctx.close()
    return tail_bytes


def kernel_group_record(ctx, chunk_size, g, og=None):
    """What a case records of kernel group g: its layers, format, blocks, and
    its region of the object of object group og (0, and not recorded, unless
    given)."""
    mgr = ctx.kv_layer_groups_manager
    kg = mgr.kernel_groups[g]
    layout = get_layout_desc(ctx, chunk_size, object_group_id=og or 0)
    pos = mgr.object_groups[og or 0].kernel_group_indices.index(g)
    shape, dtype = list(layout.shapes[pos]), layout.dtypes[pos]
    slots = ctx.get_slots_per_chunk_in_sw(g)
    keep = ctx.calculate_num_blocks(
        min(chunk_size, mgr.get_subchunk_sw_size_tokens(g)), g
    )
    assert shape[2] == chunk_size and keep * int(kg.shape_desc.bs) == slots
    rec = {
        "layers": list(kg.layer_indices),
        "engine_kv_format": ctx.get_engine_kv_format(g).name,
        "block_size": int(kg.shape_desc.bs),
        "blocks_per_chunk": ctx.calculate_num_blocks(chunk_size, g),
        "object_shape": shape,
        "object_dtype": DT_NAME[dtype],
    }
    if og is not None:
        rec["object_group"] = og
    rec.update({
        "object_offset": ctx.get_kernel_group_offset_in_object(og or 0, g),
        "sw_size_tokens": int(kg.sw_size_tokens),
        "transfer_slots": slots,
        "keep_blocks": keep,
        "region_bytes": math.prod(shape) * dtype.itemsize,
        "transfer_region_bytes": shape[0] * shape[1] * slots * shape[3]
        * dtype.itemsize,
    })
    return rec


def case_header(name, chunk_size, num_chunks, specs, infos):
    """The fields every golden case starts with: its registration."""
    return {
        "name": name,
        "chunk_size": chunk_size,
        "layout_hint": LAYOUT_HINT,
        "num_chunks": num_chunks,
        "tensors": [
            {
                "dtype": dtype_name,
                "shape": list(shape),
                "stride": tight_stride(shape),
                "storage_offset": 0,
                "storage_bytes": math.prod(shape) * DT[dtype_name].itemsize,
            }
            for dtype_name, shape in specs
        ],
        "engine_group_infos": [
            {
                "engine_group_id": i.engine_group_id,
                "layer_indices": list(i.layer_indices),
                "tokens_per_block": i.tokens_per_block,
                "sw_size_tokens": i.sw_size_tokens,
                "extra_object_group_tag": i.extra_object_group_tag,
                "recurrent_state": i.recurrent_state,
            }
            for i in infos
        ],
    }


def run_case(l1, name, chunk_size, num_chunks, specs, groups, seed, skips=None):
    """specs: [(dtype, shape)] in registration order;
    groups: [(layer_indices, tokens_per_block[, sw_size_tokens])] in engine
    group order; skips: the RETRIEVE skip_first_n_tokens values (default: one
    block + 1 token of the largest block size, then chunk + 13)."""
    infos = make_infos(groups)
    tensors, ctx = register(specs, False, chunk_size, infos)
    mgr = ctx.kv_layer_groups_manager
    assert mgr.num_object_groups == 1, mgr.object_groups
    assert mgr.object_groups[0].kernel_group_indices == list(
        range(mgr.num_kernel_groups)
    )
    layout = get_layout_desc(ctx, chunk_size, object_group_id=0)
    kgs = [kernel_group_record(ctx, chunk_size, g) for g in range(mgr.num_kernel_groups)]
    bpcs = [kg["blocks_per_chunk"] for kg in kgs]
    nbs = [int(kg.shape_desc.nb) for kg in mgr.kernel_groups]
    rng = random.Random(seed)
    store_ids = [rng.sample(range(1, nb), num_chunks * b) for nb, b in zip(nbs, bpcs)]
    retr_ids = [rng.sample(range(1, nb), num_chunks * b) for nb, b in zip(nbs, bpcs)]

    # ---- STORE (D2H), as LMCacheDrivenTransferModule.store does ----
    err, objs = l1.allocate(layout, num_chunks)
    assert len(objs) == num_chunks, err
    object_bytes = objs[0].get_size()
    tmp_nonzero = int((ctx.tmp_cpu_buffer_ != 0).sum())  # torch.empty: garbage
    # Pin the uninitialised temp buffer: sliding-window tails become zeros.
    ctx.tmp_cpu_buffer_.zero_()
    staged_ids = store(ctx, objs, store_ids)
    for g, kg in enumerate(kgs):
        bpc, keep = kg["blocks_per_chunk"], kg["keep_blocks"]
        assert staged_ids[g] == [
            b for c in range(num_chunks)
            for b in store_ids[g][(c + 1) * bpc - keep : (c + 1) * bpc]
        ]
    objects = [o.raw_tensor[:object_bytes].numpy().tobytes() for o in objs]
    for c, ob in enumerate(objects):
        assert ob == hand_object(tensors, kgs, store_ids, c), (name, c)
    tail_bytes = check_poisoned_store(
        l1, specs, infos, chunk_size, layout, store_ids, objects, kgs, seed
    )

    # ---- RETRIEVE (H2D) into zero tensors of a second registration ----
    if skips is None:
        skips = [max(kg["block_size"] for kg in kgs) + 1, chunk_size + 13]
        assert skips[0] < chunk_size
    retrieves = []
    for skip in skips:
        assert 0 <= skip < num_chunks * chunk_size
        dst_tensors, ctx2 = register(specs, True, chunk_size, infos)
        host_ids2 = [list(x) for x in retr_ids]
        staged2 = downsample_and_stage_block_ids(ctx2, host_ids2)
        transfer_kv_per_object_group(
            ctx2,
            staged2,
            objs,
            object_group_id=0,
            batch_size=ctx2.max_batch_size,
            skip_first_n_tokens=skip,
            direction=native.TransferDirection.H2D,
            transfer_key="golden-retrieve",
            block_ids_host=host_ids2,
        )
        ctx2.stream.synchronize()
        paged = [hashlib.sha256(storage_bytes(x)).hexdigest() for x in dst_tensors]
        want_paged, want_written = hand_retrieve(
            specs, kgs, objects, retr_ids, skip, chunk_size
        )
        assert paged == want_paged, (name, skip)
        written = written_blocks(dst_tensors, kgs, retr_ids)
        assert written == want_written, (name, skip, written, want_written)
        retrieves.append(
            {
                "batch_size": ctx2.max_batch_size,
                "block_ids": retr_ids,
                "skip_first_n_tokens": skip,
                "paged_sha256": paged,
                "written_block_ids": written,
            }
        )
        ctx2.close()
    l1.free(objs)
    ctx.close()

    case = case_header(name, chunk_size, num_chunks, specs, infos)
    case.update({
        "kernel_groups": kgs,
        "object_bytes": object_bytes,
        "store": {
            "batch_size": 1,
            "block_ids": store_ids,
            "objects_hex": [o.hex() for o in objects],
            "objects_sha256": [hashlib.sha256(o).hexdigest() for o in objects],
        },
        "retrieve": {k: v for k, v in retrieves[0].items() if k != "written_block_ids"},
    })
    if any(kg["keep_blocks"] != kg["blocks_per_chunk"] for kg in kgs):
        case["store"]["staged_block_ids"] = staged_ids
    case["retrieves"] = retrieves
    print(name, "temp buffer bytes non-zero at creation:", tmp_nonzero, "of",
          ctx.tmp_cpu_buffer_.numel(), "; tail bytes per object:", tail_bytes)
    return case


def sw_size_checks(l1):
    """Which sliding-window sizes 0.5.6 accepts (block size 4, chunk 16), and
    whether a one-chunk STORE then runs."""
    f16 = "float16"
    specs = [(f16, (2, 8, 4, 2, 8)), (f16, (2, 8, 4, 1, 8))]
    out = []
    for sw in (6, 2, 3, 0, -2, 18):
        rec = {"sw_size_tokens": sw, "tokens_per_block": 4, "block_size": 4,
               "chunk_size": 16}
        try:
            _, ctx = register(specs, False, 16, make_infos([([0], 4), ([1], 4, sw)]))
        except Exception as e:  # noqa: BLE001
            rec.update(accepted=False, stage="create_cache_context",
                       error=f"{type(e).__name__}: {e}")
            out.append(rec)
            continue
        mgr = ctx.kv_layer_groups_manager
        rec.update(
            accepted=True,
            subchunk_sw_size_tokens=mgr.get_subchunk_sw_size_tokens(1),
            transfer_slots=ctx.get_slots_per_chunk_in_sw(1),
            keep_blocks=ctx.calculate_num_blocks(
                min(16, mgr.get_subchunk_sw_size_tokens(1)), 1
            ),
        )
        layout = get_layout_desc(ctx, 16, object_group_id=0)
        err, objs = l1.allocate(layout, 1)
        assert len(objs) == 1, err
        try:
            staged = store(ctx, objs, [[1, 2, 3, 4], [5, 6, 7, 1]])
            rec.update(stage="store", error=None, staged_block_ids=staged)
        except Exception as e:  # noqa: BLE001
            rec.update(stage="store", error=f"{type(e).__name__}: {e}")
        l1.free(objs)
        ctx.close()
        out.append(rec)
    return out


def main():
    l1 = L1MemoryManager(
        L1MemoryManagerConfig(size_in_bytes=4 << 20, use_lazy=False, shm_name="")
    )
    f16, bf16 = "float16", "bfloat16"
    cases = [
        run_case(
            l1, "two_classical_f16_bf16", 16, 3,
            [(f16, (2, 16, 4, 4, 16)), (f16, (2, 16, 4, 4, 16)),
             (bf16, (2, 16, 4, 2, 8)), (bf16, (2, 16, 4, 2, 8))],
            [([0, 1], 4), ([2, 3], 4)], seed=1,
        ),
        run_case(
            l1, "classical_f16_plus_mla_bf16", 16, 3,
            [(f16, (2, 16, 4, 2, 16)), (f16, (2, 16, 4, 2, 16)),
             (bf16, (16, 4, 36)), (bf16, (16, 4, 36))],
            [([0, 1], 4), ([2, 3], 4)], seed=2,
        ),
        run_case(
            l1, "three_groups_u8_i8_f32", 16, 3,
            [("uint8", (2, 16, 4, 2, 16)), ("int8", (2, 16, 4, 2, 8)),
             ("float32", (2, 16, 4, 1, 8))],
            [([0], 4), ([1], 4), ([2], 4)], seed=3,
        ),
        run_case(
            l1, "block_sizes_4_and_8_f16", 16, 3,
            [(f16, (2, 16, 4, 2, 8)), (f16, (2, 16, 4, 2, 8)),
             (f16, (2, 8, 8, 2, 8)), (f16, (2, 8, 8, 2, 8))],
            [([0, 1], 4), ([2, 3], 8)], seed=4,
        ),
        run_case(
            l1, "interleaved_layers_f16", 16, 5,
            [(f16, (2, 24, 4, 2, 8)), (f16, (2, 24, 4, 1, 8)),
             (f16, (2, 24, 4, 2, 8)), (f16, (2, 24, 4, 1, 8))],
            [([0, 2], 4), ([1, 3], 4)], seed=5,
        ),
        # Sub-chunk sliding windows: group 1 keeps the last 2 of 4 blocks.
        run_case(
            l1, "sliding_window_8_of_16_f16", 16, 5,
            [(f16, (2, 24, 4, 2, 16)), (f16, (2, 24, 4, 2, 16)),
             (f16, (2, 24, 4, 1, 16)), (f16, (2, 24, 4, 1, 16))],
            [([0, 1], 4), ([2, 3], 4, 8)], seed=6, skips=[5, 22, 29],
        ),
        # MLA group keeps the last block of each chunk.
        run_case(
            l1, "sliding_window_4_mla_bf16", 16, 3,
            [(f16, (2, 16, 4, 2, 16)), (f16, (2, 16, 4, 2, 16)),
             (bf16, (16, 4, 36)), (bf16, (16, 4, 36))],
            [([0, 1], 4), ([2, 3], 4, 4)], seed=7, skips=[5, 29],
        ),
    ]
    # Windows of at least a chunk (40 > 16, and exactly 16) change nothing.
    wide_specs = [(f16, (2, 16, 4, 2, 8)), (f16, (2, 16, 4, 2, 8)),
                  (f16, (2, 16, 4, 1, 8)), (f16, (2, 16, 4, 1, 8)),
                  (f16, (2, 8, 8, 2, 8))]
    wide = run_case(
        l1, "sliding_window_wide_f16", 16, 3, wide_specs,
        [([0, 1], 4), ([2, 3], 4, 40), ([4], 8, 16)], seed=8, skips=[5, 29],
    )
    twin = run_case(
        l1, "sliding_window_wide_f16_as_full_attention", 16, 3, wide_specs,
        [([0, 1], 4), ([2, 3], 4), ([4], 8)], seed=8, skips=[5, 29],
    )
    strip = ("sw_size_tokens",)
    assert [{k: v for k, v in kg.items() if k not in strip}
            for kg in wide["kernel_groups"]] == [
        {k: v for k, v in kg.items() if k not in strip}
        for kg in twin["kernel_groups"]]
    assert wide["store"] == twin["store"]
    assert wide["retrieves"] == twin["retrieves"]
    assert "staged_block_ids" not in wide["store"]
    cases.append(wide)
    out = {
        "lmcache_version": "0.5.6",
        "fill": "byte i of tensor t = (i*31 + t*7 + 1) % 251",
        "cases": cases,
        "sw_size_checks": sw_size_checks(l1),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "golden_group_gather.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for c in cases:
        print(c["name"], c["object_bytes"],
              [(k["layers"], k["engine_kv_format"], k["block_size"],
                k["blocks_per_chunk"], k["keep_blocks"], k["transfer_slots"])
               for k in c["kernel_groups"]])
    for r in out["sw_size_checks"]:
        print("sw_size_tokens", r["sw_size_tokens"], r)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
