// kvshard KV block copy: paged engine KV cache <-> contiguous L1 chunk objects.
//
// Compiled at run time with NVRTC (see nvrtc.rs); no CUDA headers needed.
// Launch: grid = (kv_size, total_blocks, nl), one thread block per
// (kv plane, flat block, layer). Threads in x stride over the units of one
// head, y selects the head, z strides over the tokens of the block.
//
// All engine strides arrive precomputed in units of U (the copy width) in a
// KvLayout mirrored by `KernelLayout` in kernel.rs, so every engine format
// shares this one body; only the HND token order and the blocked-scale split
// (format NL_X_NB_BSV_BSS) branch. Offsets are 64-bit throughout: a block
// index times the block step passes 2^31 units on large pools.

typedef unsigned long long kv_u64;
typedef long long kv_i64;

// Up to four chunk objects per launch (lmcache's max batch of 4).
struct KvObjects {
  kv_u64 ptr[4];
};

// Keep in the same order and sizes as `KernelLayout` in kernel.rs.
struct KvLayout {
  kv_i64 block_step;   // engine units per block id
  kv_i64 layer_step;   // engine units per layer inside one tensor (cross-layer)
  kv_i64 kv_step;      // engine units per KV plane inside one tensor
  kv_i64 num_blocks;   // ids outside [0, num_blocks) are never dereferenced
  int head_units;      // units per head of one token
  int ptr_layer_mul;   // base pointer index = layer * ptr_layer_mul
  int ptr_kv_mul;      //                    + kv * ptr_kv_mul
  int nl;
  int bs;              // token slots per block
  int nh;
  int hnd;             // 1: heads before tokens inside a block
  int blocked_scale;   // 1: [bs x values][bs x 4-byte scale] per block
  int chunk_slots;     // token slots per object
  int blocks_per_object;
  int skip_blocks;     // leading flat blocks left untouched
  int total_blocks;
};

static_assert(sizeof(KvObjects) == 32, "KvObjects must match KernelObjects");
static_assert(sizeof(KvLayout) == 80, "KvLayout must match KernelLayout");

// Streaming (evict-first) loads and stores: the data is touched once.
template <typename U>
__device__ __forceinline__ void move_units(U* __restrict__ dst, const U* __restrict__ src,
                                           kv_i64 n) {
  for (kv_i64 i = threadIdx.x; i < n; i += blockDim.x) {
    __stcs(dst + i, __ldcs(src + i));
  }
}

template <typename U, bool TO_ENGINE>
__device__ __forceinline__ void copy_run(U* engine, U* object, kv_i64 n) {
  if (TO_ENGINE) {
    move_units<U>(engine, object, n);
  } else {
    move_units<U>(object, engine, n);
  }
}

template <typename U, bool TO_ENGINE>
__device__ __forceinline__ void kv_block_copy(const kv_u64* __restrict__ paged, const KvObjects& objs,
                                              const kv_i64* __restrict__ ids, const KvLayout& L) {
  const int kv = blockIdx.x;
  const int flat = blockIdx.y;
  const int layer = blockIdx.z;
  if (flat < L.skip_blocks || flat >= L.total_blocks) return;
  const kv_i64 block_id = ids[flat];
  // The host rejects such ids before launch; this keeps a bad id from ever
  // becoming a write into someone else's memory.
  if (block_id < 0 || block_id >= L.num_blocks) return;

  const int obj = flat / L.blocks_per_object;
  const kv_i64 slot0 = (kv_i64)(flat - obj * L.blocks_per_object) * L.bs;
  const kv_i64 row = (kv_i64)L.nh * L.head_units;  // units per token, object side

  U* engine = reinterpret_cast<U*>(paged[(kv_i64)layer * L.ptr_layer_mul + (kv_i64)kv * L.ptr_kv_mul]) +
              block_id * L.block_step + (kv_i64)layer * L.layer_step + (kv_i64)kv * L.kv_step;
  U* object = reinterpret_cast<U*>(objs.ptr[obj]) +
              (((kv_i64)kv * L.nl + layer) * L.chunk_slots + slot0) * row;

  if (L.blocked_scale) {
    // nh == 1; the scale is 4 bytes = 4 / sizeof(U) units after the values.
    const kv_i64 scale_units = 4 / (kv_i64)sizeof(U);
    const kv_i64 value_units = row - scale_units;
    if (threadIdx.y != 0) return;
    for (kv_i64 t = threadIdx.z; t < L.bs; t += blockDim.z) {
      copy_run<U, TO_ENGINE>(engine + t * value_units, object + t * row, value_units);
      copy_run<U, TO_ENGINE>(engine + (kv_i64)L.bs * value_units + t * scale_units,
                             object + t * row + value_units, scale_units);
    }
    return;
  }

  const kv_i64 h = threadIdx.y;
  if (h >= L.nh) return;
  for (kv_i64 t = threadIdx.z; t < L.bs; t += blockDim.z) {
    const kv_i64 engine_off = L.hnd ? (h * L.bs + t) * L.head_units : h * L.head_units + t * row;
    const kv_i64 object_off = h * L.head_units + t * row;
    copy_run<U, TO_ENGINE>(engine + engine_off, object + object_off, L.head_units);
  }
}

// Gather: engine -> objects (store). Scatter: objects -> engine (retrieve).
// The suffix is the unit width in bytes.
extern "C" __global__ void __launch_bounds__(1024)
kv_gather_u16(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<uint4, false>(paged, objs, ids, layout);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_gather_u4(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<unsigned int, false>(paged, objs, ids, layout);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_gather_u2(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<unsigned short, false>(paged, objs, ids, layout);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_scatter_u16(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<uint4, true>(paged, objs, ids, layout);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_scatter_u4(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<unsigned int, true>(paged, objs, ids, layout);
}

extern "C" __global__ void __launch_bounds__(1024)
kv_scatter_u2(const kv_u64* __restrict__ paged, KvObjects objs, const kv_i64* __restrict__ ids, KvLayout layout) {
  kv_block_copy<unsigned short, true>(paged, objs, ids, layout);
}
