// Sigmoid top-k router for T <= 8 tokens, matching `route()` in model/reference.py:
//   logits = x . gate^T (fp32 sums), scores = sigmoid(logits), chosen = top-A of (scores + bias),
//   weights = scores[chosen] / sum(scores[chosen]) * scaling; ids and weights in descending order
//   of score + bias (ties: lower expert id).
//
// router_topk_cluster (E <= 256, weights fit in shared memory): one cluster of 8 CTAs, each owning
// E/8 experts. Before waiting on the previous kernel each CTA bulk-copies its gate rows into
// shared memory; after it, x goes to shared memory, the logits come from mma.sync, and each CTA
// writes its sigmoid scores into CTA 0's shared memory (distributed shared memory); one cluster
// barrier later CTA 0 selects. No global round trips between the partial sums and the selection.
// router_topk_cluster_norm: the same from the unnormalized rows, which it normalizes first (with
// rmsnorm.cu's bits) and writes out for the experts: the norm before the MoE without a launch.
//
// router_topk (any E <= ROUTER_MAX_EXPERTS): grid (E/16 row tiles, K splits); each CTA writes fp32
// partial logits to `partial` [splits][T][E]; the last CTA to take a ticket sums them in split
// order (deterministic), selects, and resets the ticket to 0 so that the kernel replays in a CUDA
// graph. ROUTER_MAX_EXPERTS (256 or 1024) is a compile-time define.
#include "async_copy.cuh"
#include "gemv_tile.cuh"
#include "topk.cuh"
#include "norm.cuh"

#ifndef ROUTER_WARPS
#define ROUTER_WARPS 8  // a define: cuda/decode_step.cu builds it on its CTA's warps
#endif
#define ROUTER_UNROLL 4
#define ROUTER_MAX_SPLITS 8  // kernels/moe.py MAX_ROUTER_SPLITS

// One CTA of router_topk: rows tile * 16 .. + 15, k split `split` of `splits`; `ctas` CTAs in all
// take the ticket (the last selects).
__device__ __forceinline__ void router_topk_cta(int tile, int split, int splits, int ctas, int* ids, float* weights,
                                                const u16* x, const u16* gate, const float* bias, float* partial,
                                                u32* ticket, int T, int E, int K, int A, float scaling) {
  __shared__ float red[ROUTER_WARPS * 4 * 32];
  __shared__ Bf16Weights::Shared sh;
  __shared__ u32 is_last;
  extern __shared__ float scores[];  // [T][E], last CTA only
  pdl_launch_dependents();
  const int g = (threadIdx.x & 31) >> 2, warp = threadIdx.x >> 5;
  const int n0 = tile * 16;
  const int steps = (K + Bf16Weights::KSTEP - 1) / Bf16Weights::KSTEP;
  const Bf16Weights w{gate};
  if (threadIdx.x == 0 && split == 0) w.prefetch(n0, min(16, E - n0), K);
  const Bf16Rows rows = Bf16Weights::rows(w, min(n0 + g, E - 1), w, min(n0 + g + 8, E - 1), K);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  tile_partial<Bf16Weights, ROUTER_WARPS, ROUTER_UNROLL, true>(acc, rows, g < T ? x + (size_t)g * K : nullptr, K,
                                                         split * steps / splits,
                                                         (split + 1) * steps / splits, sh);
  tile_store_partials<ROUTER_WARPS>(red, acc);
  __syncthreads();
  const int r = threadIdx.x >> 3, b = threadIdx.x & 7, n = n0 + r;
  if (r < 16 && n < E && b < T) partial[((size_t)split * T + b) * E + n] = tile_sum<ROUTER_WARPS>(red, r, b);

  // Classic last-block pattern: the barrier orders every thread's stores before thread 0's
  // (cumulative) fence and ticket; the last CTA fences again before reading.
  __syncthreads();
  if (threadIdx.x == 0) is_last = ticket_arrive(ticket) == (u32)ctas - 1;
  __syncthreads();
  if (!is_last) return;
  ticket_acquire();
  for (int i = threadIdx.x; i < T * E; i += blockDim.x) {
    const int tok = i / E, e = i - tok * E;
    float part[ROUTER_MAX_SPLITS];  // issue every load, then sum in split order
#pragma unroll
    for (int s = 0; s < ROUTER_MAX_SPLITS; ++s)
      part[s] = s < splits ? ld_cg_f32(partial + ((size_t)s * T + tok) * E + e) : 0.0f;
    float logit = 0.0f;
#pragma unroll
    for (int s = 0; s < ROUTER_MAX_SPLITS; ++s) logit += part[s];
    scores[i] = 1.0f / (1.0f + expf(-logit));
  }
  __syncthreads();
  for (int tok = warp; tok < T; tok += ROUTER_WARPS)
    router_select(ids + tok * A, weights + tok * A, scores + tok * E, bias, E, A, scaling);
  if (threadIdx.x == 0) *ticket = 0u;
}

extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk(int* ids, float* weights, const u16* x, const u16* gate, const float* bias,
            float* partial, u32* ticket, int T, int E, int K, int A, float scaling) {
  router_topk_cta(blockIdx.x, blockIdx.y, gridDim.y, gridDim.x * gridDim.y, ids, weights, x, gate, bias, partial,
                  ticket, T, E, K, A, scaling);
}

// ---- cluster router ------------------------------------------------------------------------------

#define RC_CTAS 8       // kernels/moe.py CLUSTER_CTAS: one cluster, portable size
// RC_ST_ASYNC (kernels/moe.py ROUTER_ST_ASYNC): the scores reach the CTAs that select by st.async,
// counted in bytes on each one's own mbarrier (router_scores_bar), instead of DSMEM stores and a
// second cluster barrier (whose release costs every CTA a MEMBAR.GPU); the others leave at once.
#ifndef RC_ST_ASYNC
#define RC_ST_ASYNC 0
#endif
#define RC_WARPS 8
#define RC_MAX_TILES 2  // 16-row tiles per CTA: E <= RC_CTAS * 32

__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// Dynamic shared memory, rows `pitch` = 2K + 16 bytes apart (the pad puts the 8 rows of every
// ldmatrix, and the 8 token rows of the B fragments, in distinct banks):
//   gate rows [tiles * 16][pitch] | x [T][pitch] | scores [T][E] fp32 | bias [E]
struct RouterSmem {
  unsigned char* w;  // this CTA's gate rows: experts e0 .. e0 + n_rows - 1
  unsigned char* x;
  float* scores;     // [T][E]: filled by every CTA of the cluster (DSMEM)
  float* bias;
  int pitch, tiles, e0, n_rows;
};

__device__ __forceinline__ RouterSmem router_smem(unsigned char* smem, u32 rank, int T, int E, int K) {
  RouterSmem s;
  const int per_cta = (E + RC_CTAS - 1) / RC_CTAS;
  s.tiles = (per_cta + 15) / 16;
  s.e0 = rank * per_cta;
  s.n_rows = max(0, min(per_cta, E - s.e0));
  s.pitch = 2 * K + 16;
  s.w = smem;
  s.x = s.w + s.tiles * 16 * s.pitch;
  s.scores = reinterpret_cast<float*>(s.x + T * s.pitch);
  s.bias = s.scores + T * E;
  return s;
}

// Before the wait (warp 0): this CTA's gate rows, one bulk copy per row, completing on `bar`
// (initialized for one arrival).
__device__ __forceinline__ void router_load_gate(const RouterSmem& s, const u16* gate, u32 bar, int K) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp == 0) {
    if (lane == 0) mbarrier_arrive_expect_tx(bar, (u32)s.n_rows * K * 2);
    __syncwarp();
    for (int r = lane; r < s.n_rows; r += 32)
      bulk_copy_g2s(smem_addr(s.w + r * s.pitch), gate + (size_t)(s.e0 + r) * K, K * 2, bar);
  }
}

// After the wait, every thread: x's rows into shared memory; NORM: normalized there in place
// (norm.cuh norm_rows_shared; CTA `rank` writes its share of them to `normed` when WRITE).
template <bool NORM, bool WRITE = true>
__device__ __forceinline__ void router_stage_x(const RouterSmem& s, const u16* x, const uint4 (&wv)[NORM_MAX_VEC],
                                               u16* normed, u32 rank, int T, int K, float eps) {
  stage_rows_shared(s.x, s.pitch, x, T, K);
  if constexpr (NORM) norm_rows_shared<WRITE>(s.x, s.pitch, wv, normed, rank, RC_CTAS, T, K, eps);
}

// RC_ST_ASYNC, thread 0 before its fence_mbarrier_init and the cluster's first arrive: the barrier
// on which a CTA that receives the scores counts their T x E x 4 bytes.
__device__ __forceinline__ void router_scores_bar(u32 scores_bar, bool receives, int T, int E) {
  if (RC_ST_ASYNC && receives) {
    mbarrier_init(scores_bar, 1);
    mbarrier_arrive_expect_tx(scores_bar, (u32)(T * E * 4));
  }
}

// Every thread: this CTA's logits on tensor cores (D[16 rows][8 tokens] += W . x^T, once the gate
// rows have landed on `bar`), their sigmoid into the scores of cluster CTAs first_rank..last_rank
// (distributed shared memory). Called after a cluster_arrive_relaxed of this CTA (every CTA has
// started before any writes); returns once every CTA's scores are in place in those CTAs (RC_ST_ASYNC:
// in this CTA, if it is one of them; scores_bar as router_scores_bar made it).
__device__ __forceinline__ void router_scores(const RouterSmem& s, float* red, u32 bar, int T, int E, int K,
                                              u32 first_rank, u32 last_rank, u32 scores_bar = 0u) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  mbarrier_wait_parity(bar, 0);
  // Warp -> (tile, k range)
  const int warps_per_tile = RC_WARPS / s.tiles, tile = warp / warps_per_tile, split = warp - tile * warps_per_tile;
  const int steps = K / 16, s_begin = split * steps / warps_per_tile, s_end = (split + 1) * steps / warps_per_tile;
  const int a_row = tile * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, a_k = (lane >> 4) * 8;
  const u32 a_base = smem_addr(s.w + a_row * s.pitch + a_k * 2);
  const u32 b_base = smem_addr(s.x + g * s.pitch + 4 * t);
  const bool has_token = g < T;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k = s_begin; k < s_end; ++k) {
    u32 a[4];
    ldmatrix_x4(a, a_base + 32 * k);
    const u32 b0 = has_token ? ld_shared_u32(b_base + 32 * k) : 0u;
    const u32 b1 = has_token ? ld_shared_u32(b_base + 32 * k + 16) : 0u;
    mma_bf16_16x8x16(acc, a[0], a[1], a[2], a[3], b0, b1);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red[(warp * 4 + i) * 32 + lane] = acc[i];
  __syncthreads();

  // Thread -> (row r of this CTA, token b): sum the tile's warps in order, sigmoid, into the CTAs.
  cluster_wait_acquire();
  const int r = threadIdx.x >> 3, b = threadIdx.x & 7;
  if (r < s.n_rows && b < T) {
    const int rt = r & 15, first = (r >> 4) * warps_per_tile;
    const int src_lane = (rt & 7) * 4 + (b >> 1), i = ((rt >> 3) << 1) | (b & 1);
    float logit = 0.0f;
    for (int w = first; w < first + warps_per_tile; ++w) logit += red[(w * 4 + i) * 32 + src_lane];
    const float score = 1.0f / (1.0f + expf(-logit));
    const u32 at = smem_addr(s.scores + b * E + s.e0 + r);
    for (u32 q = first_rank; q <= last_rank; ++q) {
#if RC_ST_ASYNC
      st_async_u32(cluster_map(at, q), __float_as_uint(score), cluster_map(scores_bar, q));
#else
      st_cluster_f32(cluster_map(at, q), score);
#endif
    }
  }
#if RC_ST_ASYNC
  const u32 rank = cluster_ctarank();
  if (rank >= first_rank && rank <= last_rank) mbarrier_wait_parity_cluster(scores_bar, 0);
#else
  cluster_arrive_release();
  cluster_wait_acquire();
#endif
}

// NORM: x is the residual stream h; the router reads rms_norm(h, norm_weight), which it also
// writes to `normed` (norm_rows_shared): the post-attention norm's launch folded in.
template <bool NORM>
__device__ __forceinline__ void router_cluster(int* ids, float* weights, const u16* x, const u16* gate,
                                               const float* bias, int T, int E, int K, int A, float scaling,
                                               const u16* norm_weight, u16* normed, float eps) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ u64 bar;
  __shared__ float red[RC_WARPS * 4 * 32];
#if RC_ST_ASYNC
  __shared__ u64 scores_bar;
#endif
  pdl_launch_dependents();
  const u32 rank = cluster_ctarank();
  const RouterSmem s = router_smem(smem, rank, T, E, K);

  // Before the wait: this CTA's gate rows, CTA 0 also the bias.
  const u32 bar_addr = smem_addr(&bar);
#if RC_ST_ASYNC
  const u32 scores_addr = smem_addr(&scores_bar);
#else
  const u32 scores_addr = 0u;
#endif
  if (threadIdx.x == 0) {
    mbarrier_init(bar_addr, 1);
    router_scores_bar(scores_addr, rank == 0, T, E);
    fence_mbarrier_init();
  }
  __syncthreads();
  router_load_gate(s, gate, bar_addr, K);
  if (rank == 0)
    for (int e = threadIdx.x; e < E; e += blockDim.x) s.bias[e] = bias[e];
  cluster_arrive_relaxed();  // every CTA has started: waited on before writing into CTA 0
  uint4 wv[NORM_MAX_VEC];
  if constexpr (NORM) norm_weight_load(wv, norm_weight, K / 8);

  pdl_wait();
  router_stage_x<NORM>(s, x, wv, normed, rank, T, K, eps);
  router_scores(s, red, bar_addr, T, E, K, 0, 0, scores_addr);
  if (rank != 0) return;
  for (int tok = threadIdx.x >> 5; tok < T; tok += RC_WARPS)
    router_select(ids + tok * A, weights + tok * A, s.scores + tok * E, s.bias, E, A, scaling);
}

extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(RC_WARPS * 32)
router_topk_cluster(int* ids, float* weights, const u16* x, const u16* gate, const float* bias, int T, int E,
                    int K, int A, float scaling) {
  router_cluster<false>(ids, weights, x, gate, bias, T, E, K, A, scaling, nullptr, nullptr, 0.0f);
}

extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(RC_WARPS * 32)
router_topk_cluster_norm(int* ids, float* weights, const u16* x, const u16* gate, const float* bias, int T, int E,
                         int K, int A, float scaling, const u16* norm_weight, u16* normed, float eps) {
  router_cluster<true>(ids, weights, x, gate, bias, T, E, K, A, scaling, norm_weight, normed, eps);
}
