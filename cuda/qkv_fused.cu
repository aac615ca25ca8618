// The front of a fused decode step's attention in one launch (T <= 8 rows, NVFP4 q/k/v weight):
//   qkv = rms_norm(x, norm_weight) . Wqkv^T      (rmsnorm.cu, then gemv.cu's 4-warp GEMV: same bits)
//   q_out[b, h] = rope(bf16(rms_norm(q)))        K/V rows of positions[b] into the cache
//                                                 (qk_norm_rope_kv.cu's arithmetic: same bits)
// Three launches at batch 1 are ~7.6 µs of a layer's critical path (the norm ~2, q/k/v ~4.7, the
// Q/K norm ~0.9; benchmarks/RESULTS.md session 32) for ~6 MB of weights. Here:
//
//   1. Before the wait each CTA bulk-copies its q/k/v tiles (16 rows each; tile i to CTA i % C, at
//      most QF_SLOTS a CTA) into shared memory (smem_tiles.cuh) and the RoPE tables of the step's
//      positions (step inputs, written before the step's first kernel).
//   2. After it, every CTA stages the T rows and normalizes them in place (norm_rows_shared).
//   3. Each of the CTA's two 4-warp quads multiplies a tile as a 4-warp gemv CTA does; the q/k/v
//      rows go to `qkv`; a grid-wide counter.
//   4. Warp-tasks (row b, head): the Q/K norm, RoPE and the K/V write, as qk_norm_rope_kv_cta's warps.
//
// Every CTA of the grid must be resident at once (the counter): the host sizes the grid from the
// occupancy. The dependents (attention) are released first thing: griddepcontrol.launch_dependents
// takes effect only once every CTA of the grid has issued it, so a dependent's waiting CTA never
// holds an SM one of ours still needs. qkv_heads_* (below) do the same with a cluster a head and no
// counter.
//
// Shared memory (dynamic; kernels/attention.py qkv_fused_bytes mirrors it):
//   slots [QF_SLOTS][16 rows of K] | x [T][2K + 16] | cos [T][64] | sin [T][64]
// KV_FP8: the cache is e4m3 (as in qk_norm_rope_kv.cu).
#include "qk_norm_rope.cuh"
#include "norm.cuh"
#include "smem_tiles.cuh"

#define QF_WARPS 8
#define QF_THREADS (QF_WARPS * 32)
#define QF_QUAD 4     // gemv.cu's warps for q/k/v at these batches (kernels/linear.py gemv_warps)
#define QF_UNROLL 4   // gemv.cu NVFP4_UNROLL
#define QF_BF16_UNROLL 8  // gemv.cu BF16_UNROLL
#define QF_SLOTS 3
#ifndef QF_MIN_CTAS
#define QF_MIN_CTAS 1  // a define (kernels/attention.py QKV_FUSED_CTAS): 2 a SM cap the registers at 128 (a few spilled)
#endif
static_assert(QF_WARPS == 2 * QF_QUAD, "two quads a CTA");
static_assert(QF_THREADS == NORM_MAX_THREADS, "norm_rows_shared's CTA");

// One warp: row b's head `head` of the q/k/v rows (raw: lane l's dims 4l .. 4l + 3), as a warp of
// qk_norm_rope_kv_cta: q and k normalized (and rotated, with the RoPE tables of the rows), q into
// q_out, the k row and the v row into the cache at positions[b] (none for a padding row, p < 0).
__device__ __forceinline__ void head_row_out(uint2 raw, int b, int head, u16* q_out, kv_t* k_cache, kv_t* v_cache,
                                             const u16* q_norm_weight, const u16* k_norm_weight,
                                             const int* positions, const int* block_tables, int table_stride,
                                             const int* ring_slots, int page_rows, int H, int G, float eps,
                                             bool rope, const float* cos_s, const float* sin_s) {
  const int lane = threadIdx.x & 31, p = positions[b];
  const long long kv_offset =
      p >= 0 ? KvPages(block_tables, table_stride, ring_slots, page_rows, b).row(p) * G * HEAD_DIM : 0;
  if (head >= H + G) {  // v: copied as is
    if (p >= 0) store_kv4(v_cache + kv_offset + (head - H - G) * HEAD_DIM + 4 * lane, raw);
    return;
  }
  const bool is_q = head < H;
  float xs[4], w[4], y[4];
  load_bf16x4((is_q ? q_norm_weight : k_norm_weight) + 4 * lane, w);
  xs[0] = bf16x2_lo(raw.x), xs[1] = bf16x2_hi(raw.x), xs[2] = bf16x2_lo(raw.y), xs[3] = bf16x2_hi(raw.y);
  norm_rope_lanes(xs, w, eps, rope, cos_s + b * (HEAD_DIM / 2), sin_s + b * (HEAD_DIM / 2), lane, y);
  if (is_q)
    store_bf16x4(q_out + ((size_t)b * H + head) * HEAD_DIM + 4 * lane, y);
  else if (p >= 0)
    store_kv4(k_cache + kv_offset + (head - H) * HEAD_DIM + 4 * lane,
              make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3])));
}
#define QF_HEAD_OUT                                                                                             \
  q_out, k_cache, v_cache, q_norm_weight, k_norm_weight, positions, block_tables, table_stride, ring_slots,     \
      page_rows, num_q_heads, num_kv_heads, qk_eps, rope_inv_freq != nullptr, cos_s, sin_s

// N = (H + 2G) * 128 rows in three parts (q, k, v), each with its tensor scale (NVFP4): rows from
// split1 on use tensor_scale[1], from split2 on tensor_scale[2]. qkv [T, N]: scratch (the GEMV's
// output). rope_inv_freq: null for full layers (no RoPE). counters: 2 ints, zero.
// SLOTS: the tiles through shared-memory slots (NVFP4, at most QF_SLOTS a CTA); else read from
// global memory as gemv.cu reads them, asked of L2 before the wait.
template <class Wt, bool SLOTS, int U>
__device__ __forceinline__ void qkv_fused_body(u16* q_out, kv_t* k_cache, kv_t* v_cache, u16* qkv, int* counters,
                                               const u16* x, const u16* norm_weight, float eps, Wt wt, int split1,
                                               int split2, const u16* q_norm_weight, const u16* k_norm_weight,
                                               const int* positions, const int* block_tables, int table_stride,
                                               const int* ring_slots, int page_rows, int num_q_heads, int num_kv_heads,
                                               float qk_eps, const double* rope_inv_freq, int T, int N, int K) {
  extern __shared__ __align__(16) unsigned char qf_smem[];
  __shared__ u64 bars[QF_SLOTS];
  __shared__ float red[QF_WARPS * 4 * 32];
  __shared__ typename Wt::Shared sh;
  __shared__ float tensor_scales[3];  // q, k, v parts' (NVFP4)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int C = gridDim.x, c = blockIdx.x;
  const SlotShape shape = slot_shape(K);
  const int pitch = 2 * K + 16;
  unsigned char* x_smem = qf_smem + (SLOTS ? QF_SLOTS * shape.bytes : 0);
  float* cos_s = reinterpret_cast<float*>(x_smem + T * pitch);
  float* sin_s = cos_s + T * (HEAD_DIM / 2);
  const u32 slots = smem_addr(qf_smem);
  const int n_tiles = N / 16, mine = c < n_tiles ? (n_tiles - 1 - c) / C + 1 : 0;

  pdl_launch_dependents();  // first thing (see the top of this file)
  stage_tensor_scales(wt, tensor_scales, 3);
  Wt::init_shared(sh);
  if (SLOTS && threadIdx.x == 0) {
    for (int i = 0; i < QF_SLOTS; ++i) mbarrier_init(smem_addr(&bars[i]), 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  // 1. before the wait: this CTA's tiles (into slots, or asked of L2), the RoPE tables
  // (rope_table's arithmetic), the norm weight
  if constexpr (SLOTS) {
    if (warp == 0)
      for (int i = 0; i < mine; ++i)
        slot_load_rows(slots + i * shape.bytes, shape, wt, (c + i * C) * 16, K, smem_addr(&bars[i]));
  } else {
    if (threadIdx.x < mine) wt.prefetch((c + threadIdx.x * C) * 16, 16, K);
  }
  if (rope_inv_freq)
    rope_tables(cos_s, sin_s, positions, T, rope_inv_freq);
  uint4 wv[NORM_MAX_VEC];
  norm_weight_load(wv, norm_weight, K / 8);

  // 2. the rows, normalized in place
  pdl_wait();
  stage_rows_shared(x_smem, pitch, x, T, K);
  norm_rows_shared<false>(x_smem, pitch, wv, nullptr, 0, 1, T, K, eps);

  // 3. q/k/v: quad q takes the CTA's tiles 2r + q (gemv's 4-warp CTA, its epilogue)
  const int quad = warp / QF_QUAD, wq = warp % QF_QUAD;
  float* red_q = red + quad * QF_QUAD * 4 * 32;
  const u32 x_row = g < T ? smem_addr(x_smem + g * pitch) : 0u;
  for (int i0 = 0; i0 < mine; i0 += 2) {
    const int i = i0 + quad;
    if (i < mine) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (SLOTS) {
        mbarrier_wait_parity(smem_addr(&bars[i]), 0);
        slot_partial<QF_QUAD, U>(acc, slots + i * shape.bytes, shape, x_row, K, wq, sh);
      } else {
        const int n0 = (c + i * C) * 16;
        global_partial<Wt, QF_QUAD, U>(acc, Wt::rows(wt, n0 + g, wt, n0 + g + 8, K), x_row, K, wq, sh);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) red_q[(wq * 4 + k) * 32 + lane] = acc[k];
    }
    __syncthreads();
    const int tq = threadIdx.x % (QF_QUAD * 32), r = tq >> 3, b = tq & 7;
    if (i < mine && b < T) {
      const int n = (c + i * C) * 16 + r;
      const float v = tile_sum<QF_QUAD>(red_q, r, b) * wt.sum_scale((n >= split1) + (n >= split2));
      qkv[(size_t)b * N + n] = f32_to_bf16(v);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) grid_barrier(counters, C);
  __syncthreads();

  // 4. warp-tasks (row b, head): qk_norm_rope_kv_cta's warp, its q/k/v row read from L2
  const int heads = num_q_heads + 2 * num_kv_heads;
  for (int task = c * QF_WARPS + warp; task < T * heads; task += C * QF_WARPS) {
    const int b = task / heads, head = task - b * heads;
    const u16* src = qkv + (size_t)b * heads * HEAD_DIM + head * HEAD_DIM + 4 * lane;
    uint2 raw;
    asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(raw.x), "=r"(raw.y) : "l"(src) : "memory");
    head_row_out(raw, b, head, QF_HEAD_OUT);
  }
}

// ---- the same with a cluster a head: no grid-wide counter ----------------------------------------
// qkv_heads_*: a cluster of QH_CTAS CTAs a head (q heads, then k, then v), CTA r its rows
// 16 r .. 16 r + 15, one 4-warp quad a CTA (gemv's CTA: the same bits). Each CTA normalizes the rows
// itself (norm_rows_shared on 128 threads standing for rmsnorm.cu's 256), computes its tile and
// stores it into CTA 0's shared memory (distributed shared memory); after the cluster's barrier CTA 0's
// warps do the head's Q/K norm, RoPE and K/V write (qk_norm_rope_kv_cta's warp). No CTA waits on
// another cluster, so the grid needs no residency and the dependents are released at once.
// Shared memory (kernels/attention.py qkv_heads_bytes): slot (SLOTS) | x [T][2K + 16] |
// the head's rows [T][128] bf16 (CTA 0's) | cos [T][64] | sin [T][64].
// QH_ST_ASYNC (kernels/attention.py QKV_HEADS_ST_ASYNC): the tiles' rows reach CTA 0 by st.async, two
// rows a word, counted in bytes on CTA 0's mbarrier, which CTA 0 waits on; the other CTAs leave at
// once. No second cluster barrier, whose release costs each CTA a MEMBAR.GPU. The same rows.
#ifndef QH_ST_ASYNC
#define QH_ST_ASYNC 0
#endif
#define QH_CTAS (HEAD_DIM / 16)
#define QH_THREADS (QF_QUAD * 32)
static_assert(QH_THREADS * 2 == NORM_MAX_THREADS, "two of rmsnorm.cu's threads a thread");

template <class Wt, bool SLOTS, int U>
__device__ __forceinline__ void qkv_heads_body(u16* q_out, kv_t* k_cache, kv_t* v_cache, u16* qkv, const u16* x,
                                               const u16* norm_weight, float eps, Wt wt, int split1, int split2,
                                               const u16* q_norm_weight, const u16* k_norm_weight,
                                               const int* positions, const int* block_tables, int table_stride,
                                               const int* ring_slots, int page_rows, int num_q_heads, int num_kv_heads,
                                               float qk_eps, const double* rope_inv_freq, int T, int N, int K) {
  extern __shared__ __align__(16) unsigned char qh_smem[];
  __shared__ u64 bar;
  __shared__ float red[QF_QUAD * 4 * 32];
  __shared__ typename Wt::Shared sh;
  __shared__ float tensor_scales[3];  // q, k, v parts' (NVFP4)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const u32 rank = cluster_ctarank();
  const int head = blockIdx.x / QH_CTAS, n0 = blockIdx.x * 16;
  // First thing, as in every kernel (cuda/README.md; see the top of this file). Issued after the
  // wait, it kept the next kernel from starting before the one before ours had ended: the likely
  // cause of the overlap the step lost with this kernel (benchmarks/RESULTS.md session 35; this
  // placement not measured yet).
  pdl_launch_dependents();
  const SlotShape shape = slot_shape(K);
  const int pitch = 2 * K + 16;
  unsigned char* x_smem = qh_smem + (SLOTS ? shape.bytes : 0);
  u16* head_rows = reinterpret_cast<u16*>(x_smem + T * pitch);
  float* cos_s = reinterpret_cast<float*>(head_rows + T * HEAD_DIM);
  float* sin_s = cos_s + T * (HEAD_DIM / 2);
  const u32 slot = smem_addr(qh_smem);

  stage_tensor_scales(wt, tensor_scales, 3);
  Wt::init_shared(sh);
#if QH_ST_ASYNC
  __shared__ u64 rows_bar;  // CTA 0's: the head's rows have all come (8 CTAs x 16 rows x T x 2 bytes)
  if (threadIdx.x == 0) {
    if (SLOTS) mbarrier_init(smem_addr(&bar), 1);
    if (rank == 0) {
      mbarrier_init(smem_addr(&rows_bar), 1);
      mbarrier_arrive_expect_tx(smem_addr(&rows_bar), QH_CTAS * 16 * T * 2);
    }
    fence_mbarrier_init();  // before the cluster's arrive below: the other CTAs store after their wait
  }
#else
  if (SLOTS && threadIdx.x == 0) {
    mbarrier_init(smem_addr(&bar), 1);
    fence_mbarrier_init();
  }
#endif
  __syncthreads();
  // before the wait: the tile (into the slot, or asked of L2); CTA 0 the RoPE tables; the norm weight
  if constexpr (SLOTS) {
    if (warp == 0) slot_load_rows(slot, shape, wt, n0, K, smem_addr(&bar));
  } else {
    if (threadIdx.x == 0) wt.prefetch(n0, 16, K);
  }
  if (rank == 0 && rope_inv_freq)
    rope_tables(cos_s, sin_s, positions, T, rope_inv_freq);
  cluster_arrive_relaxed();  // every CTA has started: waited on before writing into CTA 0
  uint4 wv[2 * NORM_MAX_VEC];
  norm_weight_load<2>(wv, norm_weight, K / 8);

  pdl_wait();
  stage_rows_shared(x_smem, pitch, x, T, K);
  norm_rows_shared<false, 2>(x_smem, pitch, wv, nullptr, 0, 1, T, K, eps);

  // the tile: gemv's 4-warp CTA, its epilogue into CTA 0's rows of the head (and qkv)
  const u32 x_row = g < T ? smem_addr(x_smem + g * pitch) : 0u;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (SLOTS) {
    mbarrier_wait_parity(smem_addr(&bar), 0);
    slot_partial<QF_QUAD, U>(acc, slot, shape, x_row, K, warp, sh);
  } else {
    global_partial<Wt, QF_QUAD, U>(acc, Wt::rows(wt, n0 + g, wt, n0 + g + 8, K), x_row, K, warp, sh);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) red[(warp * 4 + k) * 32 + lane] = acc[k];
  __syncthreads();
  cluster_wait_acquire();
  const int r = threadIdx.x >> 3, b = threadIdx.x & 7;
  const u32 row_at = smem_addr(head_rows + b * HEAD_DIM + rank * 16 + r);  // in CTA 0
  u16 v = 0;
  if (b < T) {
    const int n = n0 + r;
    v = f32_to_bf16(tile_sum<QF_QUAD>(red, r, b) * wt.sum_scale((n >= split1) + (n >= split2)));
    if (qkv) qkv[(size_t)b * N + n] = v;
#if !QH_ST_ASYNC
    st_cluster_u16(cluster_map(row_at, 0), v);
#endif
  }
#if QH_ST_ASYNC
  const u32 next = __shfl_down_sync(0xFFFFFFFFu, (u32)v, 8);  // row r + 1 of token b (r even: lane + 8, same warp)
  if (b < T && (r & 1) == 0)
    st_async_u32(cluster_map(row_at, 0), (u32)v | (next << 16), cluster_map(smem_addr(&rows_bar), 0));
  if (rank != 0) return;
  mbarrier_wait_parity_cluster(smem_addr(&rows_bar), 0);
#else
  cluster_arrive_release();
  cluster_wait_acquire();
  if (rank != 0) return;
#endif

  // CTA 0: the head's rows, qk_norm_rope_kv_cta's warp each
  for (int bt = warp; bt < T; bt += QF_QUAD)
    head_row_out(*reinterpret_cast<const uint2*>(head_rows + bt * HEAD_DIM + 4 * lane), bt, head, QF_HEAD_OUT);
}

#define QF_COMMON_ARGS                                                                                           \
  u16 *q_out, kv_t *k_cache, kv_t *v_cache, u16 *qkv, int *counters, const u16 *x, const u16 *norm_weight, float eps
#define QF_TAIL_ARGS                                                                                           \
  int split1, int split2, const u16 *q_norm_weight, const u16 *k_norm_weight, const int *positions,            \
      const int *block_tables, int table_stride, const int *ring_slots, int page_rows, int num_q_heads,        \
      int num_kv_heads, float qk_eps, const double *rope_inv_freq, int T, int N, int K
#define QF_TAIL                                                                                                \
  split1, split2, q_norm_weight, k_norm_weight, positions, block_tables, table_stride, ring_slots, page_rows, \
      num_q_heads, num_kv_heads, qk_eps, rope_inv_freq, T, N, K

extern "C" __global__ void __launch_bounds__(QF_THREADS, QF_MIN_CTAS)
qkv_fused_nvfp4(QF_COMMON_ARGS, const u8* codes, const u8* scales, const float* tensor_scale, QF_TAIL_ARGS) {
  qkv_fused_body<Nvfp4Weights, true, QF_UNROLL>(q_out, k_cache, v_cache, qkv, counters, x, norm_weight, eps,
                                                Nvfp4Weights{codes, scales, tensor_scale}, QF_TAIL);
}

// The same reading the tiles from global memory (gemv.cu's loads, asked of L2 before the wait).
extern "C" __global__ void __launch_bounds__(QF_THREADS, QF_MIN_CTAS)
qkv_fused_direct_nvfp4(QF_COMMON_ARGS, const u8* codes, const u8* scales, const float* tensor_scale, QF_TAIL_ARGS) {
  qkv_fused_body<Nvfp4Weights, false, QF_UNROLL>(q_out, k_cache, v_cache, qkv, counters, x, norm_weight, eps,
                                                 Nvfp4Weights{codes, scales, tensor_scale}, QF_TAIL);
}

extern "C" __global__ void __launch_bounds__(QF_THREADS, QF_MIN_CTAS)
qkv_fused_direct_bf16(QF_COMMON_ARGS, const u16* w, QF_TAIL_ARGS) {
  qkv_fused_body<Bf16Weights, false, QF_BF16_UNROLL>(q_out, k_cache, v_cache, qkv, counters, x, norm_weight, eps,
                                                     Bf16Weights{w}, QF_TAIL);
}

extern "C" __global__ void __cluster_dims__(QH_CTAS, 1, 1) __launch_bounds__(QH_THREADS)
qkv_heads_nvfp4(u16* q_out, kv_t* k_cache, kv_t* v_cache, u16* qkv, const u16* x, const u16* norm_weight, float eps,
                const u8* codes, const u8* scales, const float* tensor_scale, QF_TAIL_ARGS) {
  qkv_heads_body<Nvfp4Weights, true, QF_UNROLL>(q_out, k_cache, v_cache, qkv, x, norm_weight, eps,
                                                Nvfp4Weights{codes, scales, tensor_scale}, QF_TAIL);
}

extern "C" __global__ void __cluster_dims__(QH_CTAS, 1, 1) __launch_bounds__(QH_THREADS)
qkv_heads_direct_nvfp4(u16* q_out, kv_t* k_cache, kv_t* v_cache, u16* qkv, const u16* x, const u16* norm_weight,
                       float eps, const u8* codes, const u8* scales, const float* tensor_scale, QF_TAIL_ARGS) {
  qkv_heads_body<Nvfp4Weights, false, QF_UNROLL>(q_out, k_cache, v_cache, qkv, x, norm_weight, eps,
                                                 Nvfp4Weights{codes, scales, tensor_scale}, QF_TAIL);
}

extern "C" __global__ void __cluster_dims__(QH_CTAS, 1, 1) __launch_bounds__(QH_THREADS)
qkv_heads_direct_bf16(u16* q_out, kv_t* k_cache, kv_t* v_cache, u16* qkv, const u16* x, const u16* norm_weight,
                      float eps, const u16* w, QF_TAIL_ARGS) {
  qkv_heads_body<Bf16Weights, false, QF_BF16_UNROLL>(q_out, k_cache, v_cache, qkv, x, norm_weight, eps,
                                                     Bf16Weights{w}, QF_TAIL);
}
