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


def register(specs, zero, chunk_size, infos):
    """Client side: shm-wrap each tensor; server side: create_cache_context."""
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
        separate_object_groups=False,
        full_sw_kv=False,
    )
    return tensors, ctx


def byte_view(x):
    """uint8 view with the last dim scaled by itemsize (bit-exact)."""
    return x.view(torch.uint8)


def hand_object(tensors, kgs, ids, c):
    """Rebuild chunk c by hand: per kernel group [kv, L, T, hidden] bytes."""
    parts = []
    for g, kg in enumerate(kgs):
        bpc = kg["blocks_per_chunk"]
        sel = torch.tensor(ids[g][c * bpc : (c + 1) * bpc], dtype=torch.long)
        per_layer = []
        for layer in kg["layers"]:
            b = byte_view(tensors[layer])
            if b.dim() == 5:  # (2, NB, BS, NH, HS*isz), NHD
                blk = b.index_select(1, sel)
                per_layer.append(blk.reshape(2, -1, b.shape[3] * b.shape[4]))
            else:  # MLA (NB, BS, HS*isz)
                blk = b.index_select(0, sel)
                per_layer.append(blk.reshape(1, -1, b.shape[2]))
        parts.append(torch.stack(per_layer, dim=1).contiguous().numpy().tobytes())
    return b"".join(parts)


def hand_retrieve(specs, kgs, objects, ids, skip):
    """Scatter the objects by hand into zero tensors, skipping whole blocks
    below skip_first_n_tokens // block_size (per kernel group)."""
    dst = [make_tensor(d, s, t, zero=True)[0] for t, (d, s) in enumerate(specs)]
    for c, obj in enumerate(objects):
        off = 0
        for g, kg in enumerate(kgs):
            bpc, bs = kg["blocks_per_chunk"], kg["block_size"]
            shape = kg["object_shape"]
            isz = DT[kg["object_dtype"]].itemsize
            n = math.prod(shape) * isz
            region = torch.frombuffer(bytearray(obj[off : off + n]), dtype=torch.uint8)
            region = region.view(shape[0], shape[1], shape[2], shape[3] * isz)
            off += n
            for j in range(bpc):
                if c * bpc + j < skip // bs:
                    continue
                bid = ids[g][c * bpc + j]
                for li, layer in enumerate(kg["layers"]):
                    d = byte_view(dst[layer])
                    piece = region[:, li, j * bs : (j + 1) * bs]
                    if d.dim() == 5:
                        d[:, bid] = piece.reshape(2, bs, d.shape[3], d.shape[4])
                    else:
                        d[bid] = piece.reshape(bs, d.shape[2])
        assert off == len(obj)
    return [hashlib.sha256(storage_bytes(x)).hexdigest() for x in dst]


def run_case(l1, name, chunk_size, num_chunks, specs, groups, seed):
    """specs: [(dtype, shape)] in registration order;
    groups: [(layer_indices, tokens_per_block)] in engine group order."""
    infos = [
        EngineGroupInfo(
            engine_group_id=gid,
            layer_indices=tuple(layers),
            tokens_per_block=tpb,
            sw_size_tokens=-1,
            extra_object_group_tag=0,
            recurrent_state=False,
        )
        for gid, (layers, tpb) in enumerate(groups)
    ]
    tensors, ctx = register(specs, False, chunk_size, infos)
    mgr = ctx.kv_layer_groups_manager
    assert mgr.num_object_groups == 1, mgr.object_groups
    assert mgr.object_groups[0].kernel_group_indices == list(
        range(mgr.num_kernel_groups)
    )
    layout = get_layout_desc(ctx, chunk_size, object_group_id=0)
    kgs = []
    for g, kg in enumerate(mgr.kernel_groups):
        kgs.append(
            {
                "layers": list(kg.layer_indices),
                "engine_kv_format": ctx.get_engine_kv_format(g).name,
                "block_size": int(kg.shape_desc.bs),
                "blocks_per_chunk": ctx.calculate_num_blocks(chunk_size, g),
                "object_shape": list(layout.shapes[g]),
                "object_dtype": DT_NAME[layout.dtypes[g]],
                "object_offset": ctx.get_kernel_group_offset_in_object(0, g),
            }
        )
    bpcs = [kg["blocks_per_chunk"] for kg in kgs]
    nbs = [int(kg.shape_desc.nb) for kg in mgr.kernel_groups]
    rng = random.Random(seed)
    store_ids = [rng.sample(range(1, nb), num_chunks * b) for nb, b in zip(nbs, bpcs)]
    retr_ids = [rng.sample(range(1, nb), num_chunks * b) for nb, b in zip(nbs, bpcs)]

    # ---- STORE (D2H), as LMCacheDrivenTransferModule.store does ----
    err, objs = l1.allocate(layout, num_chunks)
    assert len(objs) == num_chunks, err
    object_bytes = objs[0].get_size()
    host_ids = [list(x) for x in store_ids]
    staged = downsample_and_stage_block_ids(ctx, host_ids)
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
    objects = [o.raw_tensor[:object_bytes].numpy().tobytes() for o in objs]
    for c, ob in enumerate(objects):
        assert ob == hand_object(tensors, kgs, store_ids, c), (name, c)

    # ---- RETRIEVE (H2D) into zero tensors of a second registration ----
    skip = max(kg["block_size"] for kg in kgs) + 1
    assert skip < chunk_size
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
    assert paged == hand_retrieve(specs, kgs, objects, retr_ids, skip), name
    batch_size = ctx2.max_batch_size
    l1.free(objs)
    ctx.close()
    ctx2.close()

    tens = []
    for dtype_name, shape in specs:
        tens.append(
            {
                "dtype": dtype_name,
                "shape": list(shape),
                "stride": tight_stride(shape),
                "storage_offset": 0,
                "storage_bytes": math.prod(shape) * DT[dtype_name].itemsize,
            }
        )
    return {
        "name": name,
        "chunk_size": chunk_size,
        "layout_hint": LAYOUT_HINT,
        "num_chunks": num_chunks,
        "tensors": tens,
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
        "kernel_groups": kgs,
        "object_bytes": object_bytes,
        "store": {
            "batch_size": 1,
            "block_ids": store_ids,
            "objects_hex": [o.hex() for o in objects],
            "objects_sha256": [hashlib.sha256(o).hexdigest() for o in objects],
        },
        "retrieve": {
            "batch_size": batch_size,
            "block_ids": retr_ids,
            "skip_first_n_tokens": skip,
            "paged_sha256": paged,
        },
    }


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
    ]
    out = {
        "lmcache_version": "0.5.6",
        "fill": "byte i of tensor t = (i*31 + t*7 + 1) % 251",
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "golden_group_gather.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for c in cases:
        print(c["name"], c["object_bytes"],
              [(k["layers"], k["engine_kv_format"], k["block_size"],
                k["blocks_per_chunk"]) for k in c["kernel_groups"]])
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
