// Small-batch MoE (T <= 8 tokens, A experts per token, one optional shared expert) reading only
// the chosen experts' weights; expert ids come from the router's output on the GPU.
//
//   pairs p = token * A + slot (p < T*A), p = T*A: the shared expert
//   h[T, A + 1, I]:  h[b][slot]  = silu(x_b . Wg_e^T) * (x_b . Wu_e^T)   e = ids[b][slot]
//                    h[b][A]     = the same with the shared expert
//   y[T, H] = residual + sum_slot w[b][slot] * Wd_e . h[b][slot] + Wd_shared . h[b][A]
//
// gate/up: grid (I/8 tiles, T*A + 1 pairs); the CTA of the first pair naming an expert computes
// it for every token (the mma's 8 columns) and writes each token that chose it; the others exit.
// down: output stationary, one CTA per 16 of the H outputs, looping over the distinct experts in
// first-occurrence order then the shared one: deterministic, no atomics.
#include "gemv_tile.cuh"

#ifndef MOE_GATE_UP_WARPS
#define MOE_GATE_UP_WARPS 4  // a compile-time define: 8 for bf16 (one round of loads per warp)
#endif
#ifndef MOE_DOWN_WARPS
#define MOE_DOWN_WARPS 16  // a define: cuda/decode_step.cu runs the body on 8
#endif
#define MOE_MAX_PAIRS 64  // T * A
#define MOE_DOWN_PREFETCH_EXPERTS 8
#define BF16_UNROLL 8
#define NVFP4_UNROLL 4

// The slot of token b that chose expert e among its A (e < 0: the shared expert, slot A), or -1.
__device__ __forceinline__ int moe_slot_of(const int* pair_expert, int b, int A, int e) {
  int slot = e < 0 ? A : -1;
  for (int s = 0; s < A && slot < 0; ++s)
    if (pair_expert[b * A + s] == e) slot = s;
  return slot;
}

// One down item into a warp's accumulators: part = W . x of the item (one k-step of one expert),
// acc += its coefficient x part (tokens 2t and 2t + 1: this lane's columns).
template <class Wt>
__device__ __forceinline__ void moe_down_accumulate(float (&acc)[4], const typename Wt::Frag& frag,
                                                    const typename Wt::X& x, float c_even, float c_odd,
                                                    const typename Wt::Shared& sh) {
  float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  Wt::mma(part, frag, x, sh);
  acc[0] = fmaf(c_even, part[0], acc[0]);
  acc[1] = fmaf(c_odd, part[1], acc[1]);
  acc[2] = fmaf(c_even, part[2], acc[2]);
  acc[3] = fmaf(c_odd, part[3], acc[3]);
}

// pair_expert[] <- ids (all T * A = P pairs); e <- the expert of pair p (-1: the shared one, p == P).
// False where the CTA has nothing to do: an invalid id, or an earlier pair owns this expert
// (uniform across the CTA).
__device__ __forceinline__ bool moe_pair_expert(int* pair_expert, const int* ids, int p, int P, int E, int& e) {
  if (threadIdx.x < P) pair_expert[threadIdx.x] = ids[threadIdx.x];
  __syncthreads();
  e = -1;
  if (p == P) return true;
  e = pair_expert[p];
  if (e < 0 || e >= E) return false;
  for (int q = 0; q < p; ++q)
    if (pair_expert[q] == e) return false;
  return true;
}

// The warps' gate (tile rows 0-7) and up (8-15) sums of expert e, in order: silu(g) * u into each
// choosing token's slot of h.
__device__ __forceinline__ void moe_gate_up_store(float* red, const float (&acc)[4], u16* h, const int* pair_expert,
                                                  int e, float gate_scale, float up_scale, int j0, int T, int A,
                                                  int I) {
  tile_store_partials<MOE_GATE_UP_WARPS>(red, acc);
  __syncthreads();
  const int j = threadIdx.x >> 3, b = threadIdx.x & 7, n = j0 + j;
  if (j >= 8 || n >= I || b >= T) return;
  const int slot = moe_slot_of(pair_expert, b, A, e);
  if (slot < 0) return;  // token b did not choose this expert
  const float gv = tile_sum<MOE_GATE_UP_WARPS>(red, j, b) * gate_scale;
  const float uv = tile_sum<MOE_GATE_UP_WARPS>(red, j + 8, b) * up_scale;
  h[((size_t)b * (A + 1) + slot) * I + n] = f32_to_bf16(silu(gv) * uv);
}

template <class Wt, int U>
__device__ __forceinline__ void moe_gate_up(int tile, int pair, u16* h, const u16* x, const int* ids, const Wt& gate,
                                            const Wt& up, const Wt& shared_gate, const Wt& shared_up,
                                            int T, int A, int I, int K, int E) {
  __shared__ float red[MOE_GATE_UP_WARPS * 4 * 32];
  __shared__ typename Wt::Shared sh;
  __shared__ int pair_expert[MOE_MAX_PAIRS];
  Wt::init_shared(sh);
  pdl_wait();
  // Triggered after the wait on purpose: when moe_down starts, every CTA here has waited, so the
  // router (the kernel before this one) is complete, and moe_down reads its ids early.
  pdl_launch_dependents();
  int e;
  if (!moe_pair_expert(pair_expert, ids, pair, T * A, E, e)) return;
  const Wt wg = e < 0 ? shared_gate : gate.expert(e, I, K);
  const Wt wu = e < 0 ? shared_up : up.expert(e, I, K);
  const int g = (threadIdx.x & 31) >> 2;
  const int j0 = tile * 8;
  const int row = min(j0 + g, I - 1);
  const typename Wt::Rows rows = Wt::rows(wg, row, wu, row, K);
  const int steps = (K + Wt::KSTEP - 1) / Wt::KSTEP;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  tile_partial<Wt, MOE_GATE_UP_WARPS, U>(acc, rows, g < T ? x + (size_t)g * K : nullptr, K, 0, steps, sh);
  moe_gate_up_store(red, acc, h, pair_expert, e, wg.sum_scale(), wu.sum_scale(), j0, T, A, I);
}

// The distinct experts of this step, in first-occurrence order, then the shared one (-1):
// expert[u], and per token b the slot it used (or -1) and its coefficient (routing weight x
// sum scale, 1 x sum scale for the shared expert, 0 if unused).
template <class Wt>
__device__ __forceinline__ int moe_expert_list(int* expert, int (*slot)[8], float (*coef)[8],
                                               const int* ids, const float* routing_weights,
                                               const Wt& stack, const Wt& shared, int has_shared,
                                               int T, int A, int E) {
  __shared__ int pair_expert[MOE_MAX_PAIRS];
  __shared__ int first[MOE_MAX_PAIRS];
  __shared__ int num_experts;
  const int P = T * A, tid = threadIdx.x;
  if (tid < P) pair_expert[tid] = __ldcg(ids + tid);  // from L2: written by the router
  __syncthreads();
  if (tid < P) {
    const int e = pair_expert[tid];
    bool is_first = e >= 0 && e < E;
    for (int q = 0; q < tid && is_first; ++q) is_first = pair_expert[q] != e;
    first[tid] = is_first;
  }
  __syncthreads();
  if (tid < P && first[tid]) {
    int u = 0;
    for (int q = 0; q < tid; ++q) u += first[q];
    expert[u] = pair_expert[tid];
  }
  if (tid == 0) {
    int n = 0;
    for (int q = 0; q < P; ++q) n += first[q];
    if (has_shared) expert[n++] = -1;
    num_experts = n;
  }
  __syncthreads();
  const int U = num_experts;
  for (int i = tid; i < U * 8; i += blockDim.x) {
    const int u = i >> 3, b = i & 7, e = expert[u];
    int s = -1;
    float c = 0.0f;
    if (b < T) {
      if (e < 0) {
        s = A;
        c = shared.sum_scale();
      } else {
        for (int a = 0; a < A; ++a)
          if (pair_expert[b * A + a] == e) {
            s = a;
            c = __ldcg(routing_weights + b * A + a) * stack.sum_scale(e);
          }
      }
    }
    slot[u][b] = s;
    coef[u][b] = c;
  }
  __syncthreads();
  return U;
}

template <class Wt, int U>
__device__ __forceinline__ void moe_down(int tile, u16* y, const u16* h, const int* ids,
                                         const float* routing_weights, const Wt& stack,
                                         const Wt& shared, int has_shared, const u16* residual,
                                         int T, int A, int N, int K, int E) {
  __shared__ float red[MOE_DOWN_WARPS * 4 * 32];
  __shared__ int expert[MOE_MAX_PAIRS + 1];
  __shared__ int slot[MOE_MAX_PAIRS + 1][8];
  __shared__ float coef[MOE_MAX_PAIRS + 1][8];
  __shared__ typename Wt::Shared sh;
  Wt::init_shared(sh);
  pdl_launch_dependents();
  // The router's ids and weights are complete (see moe_gate_up): list the experts and start the
  // first round of weight loads before waiting for h.
  const int num_experts =
      moe_expert_list(expert, slot, coef, ids, routing_weights, stack, shared, has_shared, T, A, E);
  const int n0 = tile * 16;
  // Prefetched only for a few experts (batch 1: 6 + shared): with many, gate/up is bandwidth-bound
  // already and the prefetch competes with it and falls out of L2 before use (measured: batch 8
  // got slower).
  if (num_experts <= MOE_DOWN_PREFETCH_EXPERTS && threadIdx.x < num_experts) {
    const int e = expert[threadIdx.x];
    (e < 0 ? shared : stack.expert(e, N, K)).prefetch(n0, min(16, N - n0), K);
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = min(n0 + g, N - 1), row1 = min(n0 + g + 8, N - 1);
  const int steps = (K + Wt::KSTEP - 1) / Wt::KSTEP;  // per expert
  const int items = num_experts * steps;              // item = (expert u, k-step s)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  bool waited = false;
  for (int f0 = warp; f0 < items; f0 += MOE_DOWN_WARPS * U) {
    typename Wt::Frag frag[U];
    const u16* xk[U];
    float c_even[U], c_odd[U];  // coefficients of tokens 2t and 2t + 1 (this lane's columns)
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int f = f0 + i * MOE_DOWN_WARPS;
      frag[i] = Wt::zero();
      xk[i] = nullptr;
      c_even[i] = c_odd[i] = 0.0f;
      if (f < items) {
        const int u = f / steps, k = (f - u * steps) * Wt::KSTEP + t * Wt::LANE_K;
        const int e = expert[u];
        const Wt w = e < 0 ? shared : stack.expert(e, N, K);
        if (k < K) {
          frag[i] = Wt::load(Wt::rows(w, row0, w, row1, K), k);
          const int s = slot[u][g];
          if (s >= 0) xk[i] = h + ((size_t)g * (A + 1) + s) * K + k;
        }
        c_even[i] = coef[u][2 * t];
        c_odd[i] = coef[u][2 * t + 1];
      }
    }
    if (!waited) {
      pdl_wait();
      waited = true;
    }
    typename Wt::X xv[X_BATCH ? U : 1];  // the round's activation loads first (see tile_partial)
#pragma unroll
    for (int i = 0; i < (X_BATCH ? U : 0); ++i) xv[i] = xk[i] ? Wt::load_x(xk[i]) : Wt::zero_x();
#pragma unroll
    for (int i = 0; i < U; ++i) {
      if (f0 + i * MOE_DOWN_WARPS < items) {
        if (!X_BATCH) xv[0] = xk[i] ? Wt::load_x(xk[i]) : Wt::zero_x();
        moe_down_accumulate<Wt>(acc, frag[i], xv[X_BATCH ? i : 0], c_even[i], c_odd[i], sh);
      }
    }
  }
  if (!waited) pdl_wait();  // a warp with no items
  tile_store_partials<MOE_DOWN_WARPS>(red, acc);
  __syncthreads();
  const int r = threadIdx.x >> 3, b = threadIdx.x & 7, n = n0 + r;
  if (r < 16 && n < N && b < T) {
    float v = tile_sum<MOE_DOWN_WARPS>(red, r, b);
    if (residual) v += bf16_to_f32(residual[(size_t)b * N + n]);
    y[(size_t)b * N + n] = f32_to_bf16(v);
  }
}

// NOTE: at least 2 CTAs per SM: with no minimum, ptxas kept ~40 registers and issued each k-step's
// loads right before its mma (a round trip per k-step) instead of all U of them at once.
extern "C" __global__ void __launch_bounds__(MOE_GATE_UP_WARPS * 32, 2)
moe_gate_up_bf16(u16* h, const u16* x, const int* ids, const u16* gate, const u16* up,
                 const u16* shared_gate, const u16* shared_up, int T, int A, int I, int K, int E) {
  moe_gate_up<Bf16Weights, BF16_UNROLL>(blockIdx.x, blockIdx.y, h, x, ids, Bf16Weights{gate}, Bf16Weights{up},
                                        Bf16Weights{shared_gate}, Bf16Weights{shared_up}, T, A, I, K, E);
}

// NOTE: at least 2 CTAs per SM: with no minimum, ptxas kept ~40 registers and issued each k-step's
// loads right before its mma (a round trip per k-step) instead of all U of them at once.
extern "C" __global__ void __launch_bounds__(MOE_GATE_UP_WARPS * 32, 2)
moe_gate_up_nvfp4(u16* h, const u16* x, const int* ids,
                  const u8* g_codes, const u8* g_scales, const float* g_tensor_scale,
                  const u8* u_codes, const u8* u_scales, const float* u_tensor_scale,
                  const u8* sg_codes, const u8* sg_scales, const float* sg_tensor_scale,
                  const u8* su_codes, const u8* su_scales, const float* su_tensor_scale,
                  int T, int A, int I, int K, int E) {
  moe_gate_up<Nvfp4Weights, NVFP4_UNROLL>(
      blockIdx.x, blockIdx.y, h, x, ids, Nvfp4Weights{g_codes, g_scales, g_tensor_scale},
      Nvfp4Weights{u_codes, u_scales, u_tensor_scale}, Nvfp4Weights{sg_codes, sg_scales, sg_tensor_scale},
      Nvfp4Weights{su_codes, su_scales, su_tensor_scale}, T, A, I, K, E);
}

extern "C" __global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
moe_down_bf16(u16* y, const u16* h, const int* ids, const float* routing_weights, const u16* down,
              const u16* shared_down, int has_shared, const u16* residual, int T, int A, int N, int K,
              int E) {
  moe_down<Bf16Weights, BF16_UNROLL>(blockIdx.x, y, h, ids, routing_weights, Bf16Weights{down},
                                     Bf16Weights{shared_down}, has_shared, residual, T, A, N, K, E);
}

extern "C" __global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
moe_down_nvfp4(u16* y, const u16* h, const int* ids, const float* routing_weights,
               const u8* d_codes, const u8* d_scales, const float* d_tensor_scale,
               const u8* sd_codes, const u8* sd_scales, const float* sd_tensor_scale, int has_shared,
               const u16* residual, int T, int A, int N, int K, int E) {
  moe_down<Nvfp4Weights, NVFP4_UNROLL>(blockIdx.x, y, h, ids, routing_weights,
                                       Nvfp4Weights{d_codes, d_scales, d_tensor_scale},
                                       Nvfp4Weights{sd_codes, sd_scales, sd_tensor_scale}, has_shared,
                                       residual, T, A, N, K, E);
}

#if !PERSISTENT_STEP
// Gate/up with its weights staged in shared memory, NVFP4 (kernels/moe.py STAGED_GATE_UP). After
// the wait and the ids, thread 0 of an expert's owner CTA bulk-copies the tile's 8 gate and 8 up
// rows (tile rows 0-7 and 8-15 of Nvfp4Staged, as moe_gate_up pairs them), and the warps load
// all of their x while the copies land (the plain NVFP4 build, X_BATCH 0, loads each k-step's x
// next to its mma: an L2 trip after another once the weights are in). The mmas and sums are
// moe_gate_up's in its order (its warps and unroll): the same bits. I % 8 == 0, K % 128 == 0.
// Dynamic shared memory: 9K bytes (16 rows of K/2 codes and K/16 scales).
extern "C" __global__ void __launch_bounds__(MOE_GATE_UP_WARPS * 32)
moe_gate_up_staged_nvfp4(u16* h, const u16* x, const int* ids,
                         const u8* g_codes, const u8* g_scales, const float* g_tensor_scale,
                         const u8* u_codes, const u8* u_scales, const float* u_tensor_scale,
                         const u8* sg_codes, const u8* sg_scales, const float* sg_tensor_scale,
                         const u8* su_codes, const u8* su_scales, const float* su_tensor_scale,
                         int T, int A, int I, int K, int E) {
  extern __shared__ __align__(128) u8 gate_up_staged[];
  __shared__ float red[MOE_GATE_UP_WARPS * 4 * 32];
  __shared__ Nvfp4Weights::Shared sh;
  __shared__ int pair_expert[MOE_MAX_PAIRS];
  __shared__ __align__(8) u64 bar;
  const u32 tile = smem_addr(gate_up_staged), bar_w = smem_addr(&bar);
  Nvfp4Weights::init_shared(sh);
  if (threadIdx.x == 0) {
    mbarrier_init(bar_w, 1);
    fence_mbarrier_init();
  }
  pdl_wait();
  pdl_launch_dependents();  // after the wait, as moe_gate_up (down reads the ids before its own)
  const int j0 = blockIdx.x * 8;
  int e;
  if (!moe_pair_expert(pair_expert, ids, blockIdx.y, T * A, E, e)) return;
  const Nvfp4Weights wg = e < 0 ? Nvfp4Weights{sg_codes, sg_scales, sg_tensor_scale}
                                : Nvfp4Weights{g_codes, g_scales, g_tensor_scale}.expert(e, I, K);
  const Nvfp4Weights wu = e < 0 ? Nvfp4Weights{su_codes, su_scales, su_tensor_scale}
                                : Nvfp4Weights{u_codes, u_scales, u_tensor_scale}.expert(e, I, K);
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar_w, 9u * K);
    Nvfp4Staged::copy_rows(tile, 0, wg, j0, 8, K, bar_w);
    Nvfp4Staged::copy_rows(tile, 8, wu, j0, 8, K, bar_w);
  }
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const u16* xg = g < T ? x + (size_t)g * K : nullptr;
  const Nvfp4Staged::Rows rows = Nvfp4Staged::rows(tile, g, K);
  const int steps = K / Nvfp4Weights::KSTEP;
  float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  bool landed = false;
  for (int s0 = warp; s0 < steps; s0 += MOE_GATE_UP_WARPS * NVFP4_UNROLL) {
    Nvfp4Weights::X xv[NVFP4_UNROLL][1];  // the round's x first: its L2 trips overlap the copies
#pragma unroll
    for (int u = 0; u < NVFP4_UNROLL; ++u) {
      const int s = s0 + u * MOE_GATE_UP_WARPS;
      xv[u][0] = xg && s < steps ? Nvfp4Weights::load_x(xg + s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K)
                                 : Nvfp4Weights::zero_x();
    }
    if (!landed) {
      mbarrier_wait_parity(bar_w, 0);
      landed = true;
    }
#pragma unroll
    for (int u = 0; u < NVFP4_UNROLL; ++u) {
      const int s = s0 + u * MOE_GATE_UP_WARPS;
      if (s < steps)
        Nvfp4Weights::mma_groups<1>(acc, Nvfp4Staged::load(rows, s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K),
                                    xv[u], sh);
    }
  }
  moe_gate_up_store(red, acc[0], h, pair_expert, e, wg.sum_scale(), wu.sum_scale(), j0, T, A, I);
}
// Gate/up and down in one launch, NVFP4 (kernels/moe.py moe_split): no grid-wide hop between them.
// A cluster of MS_CTAS CTAs takes one expert's chunk of MS_CHUNK intermediate rows (grid (I / 16,
// pairs) as moe_gate_up's, 16 rows a CTA; a duplicate pair's cluster exits as one). Each CTA stages
// its 16 gate and 16 up rows as moe_gate_up_staged does (two 16-row tiles: gate rows 0-7 with up
// rows 0-7, then rows 8-15, each on 4 of its 8 warps as that kernel's CTA), loads its share of the
// down weight's chunk columns into registers while they land, and computes silu(g) * u of every
// token, rounded to bf16 as h is. It pushes
// that into every CTA of the cluster (st.async), so each holds the chunk's h; then each multiplies
// it by its N / MS_CTAS down rows (one k-step of 128) and adds coefficient x product into acc
// [T, N] (fixed point: common.cuh red_add_fixed, so the sum's bits do not depend on the atomics'
// order) for the tokens that chose the expert. acc holds zeros (or what to add to) before; the next
// launch adds the residual and zeroes it (rmsnorm.cu add_rmsnorm_fixed).
// I % MS_CHUNK == 0, K % 128 == 0, N % (16 * MS_CTAS) == 0, N <= 16 * MS_CTAS * MS_DOWN_TILES * MS_WARPS.
// Dynamic shared memory: 18K (the tiles) + 2 * 8 * MS_CHUNK (h).
#define MS_CTAS 8
#define MS_ROWS 16
#define MS_CHUNK (MS_CTAS * MS_ROWS)  // one NVFP4 k-step of down
#define MS_WARPS 8                    // 4 a gate/up tile
#define MS_DOWN_TILES 2               // 16-row down tiles a warp at most

extern "C" __global__ void __cluster_dims__(MS_CTAS, 1, 1) __launch_bounds__(MS_WARPS * 32, 2)
moe_split_nvfp4(long long* acc, const u16* x, const int* ids, const float* routing_weights,
                const u8* g_codes, const u8* g_scales, const float* g_tensor_scale,
                const u8* u_codes, const u8* u_scales, const float* u_tensor_scale,
                const u8* d_codes, const u8* d_scales, const float* d_tensor_scale,
                const u8* sg_codes, const u8* sg_scales, const float* sg_tensor_scale,
                const u8* su_codes, const u8* su_scales, const float* su_tensor_scale,
                const u8* sd_codes, const u8* sd_scales, const float* sd_tensor_scale,
                int T, int A, int I, int K, int N, int E) {
  constexpr int W = MS_WARPS, TW = MS_WARPS / 2;  // warps, warps of a gate/up tile
  extern __shared__ __align__(128) u8 split_smem[];
  __shared__ float red[2][TW * 4 * 32];
  __shared__ Nvfp4Weights::Shared sh;
  __shared__ int pair_expert[MOE_MAX_PAIRS];
  __shared__ float coef[8];
  __shared__ __align__(16) u16 h_mine[8][MS_ROWS];
  __shared__ __align__(8) u64 bars[2];  // the tiles landed; the chunk's h landed
  const u32 tiles = smem_addr(split_smem), h_chunk = tiles + 18 * K;
  const u32 bar_w = smem_addr(&bars[0]), bar_h = smem_addr(&bars[1]);
  Nvfp4Weights::init_shared(sh);
  if (threadIdx.x == 0) {
    mbarrier_init(bar_w, 1);
    mbarrier_init(bar_h, 1);
    mbarrier_arrive_expect_tx(bar_h, 2u * 8 * MS_CHUNK);
    fence_mbarrier_init();
  }
  __syncthreads();
  cluster_arrive_relaxed();  // every CTA has started (its bar_h set): waited on before pushing h
  pdl_wait();
  pdl_launch_dependents();  // after the wait, as moe_gate_up
  int e;
  if (!moe_pair_expert(pair_expert, ids, blockIdx.y, T * A, E, e)) return;  // the same in the whole cluster
  const u32 rank = cluster_ctarank();
  const int chunk = blockIdx.x / MS_CTAS, j0 = blockIdx.x * MS_ROWS;
  const Nvfp4Weights wg = e < 0 ? Nvfp4Weights{sg_codes, sg_scales, sg_tensor_scale}
                                : Nvfp4Weights{g_codes, g_scales, g_tensor_scale}.expert(e, I, K);
  const Nvfp4Weights wu = e < 0 ? Nvfp4Weights{su_codes, su_scales, su_tensor_scale}
                                : Nvfp4Weights{u_codes, u_scales, u_tensor_scale}.expert(e, I, K);
  const Nvfp4Weights wd = e < 0 ? Nvfp4Weights{sd_codes, sd_scales, sd_tensor_scale}
                                : Nvfp4Weights{d_codes, d_scales, d_tensor_scale}.expert(e, N, I);
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar_w, 18u * K);
    Nvfp4Staged::copy_rows(tiles, 0, wg, j0, 8, K, bar_w);
    Nvfp4Staged::copy_rows(tiles, 8, wu, j0, 8, K, bar_w);
    Nvfp4Staged::copy_rows(tiles + 9 * K, 0, wg, j0 + 8, 8, K, bar_w);
    Nvfp4Staged::copy_rows(tiles + 9 * K, 8, wu, j0 + 8, 8, K, bar_w);
  }
  if (threadIdx.x < 8) {  // token b's coefficient: routing weight x sum scale, 0 where b did not choose e
    const int b = threadIdx.x, slot = b < T ? moe_slot_of(pair_expert, b, A, e) : -1;
    coef[b] = slot < 0 ? 0.0f : (e < 0 ? 1.0f : __ldcg(routing_weights + b * A + slot)) * wd.sum_scale();
  }

  // This warp's down tiles d = warp + i * W: rows n_cta + 16 d + {g, g + 8}, the chunk's k-step.
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int n_local = N / MS_CTAS, n_cta = rank * n_local, down_tiles = n_local / 16;
  const int kd = chunk * MS_CHUNK + t * Nvfp4Weights::LANE_K;
  Nvfp4Weights::Frag fd[MS_DOWN_TILES];
#pragma unroll
  for (int i = 0; i < MS_DOWN_TILES; ++i) {
    const int n = n_cta + (warp + i * W) * 16 + g;
    fd[i] = warp + i * W < down_tiles ? Nvfp4Weights::load(Nvfp4Weights::rows(wd, n, wd, n + 8, I), kd)
                                      : Nvfp4Weights::zero();
  }

  // Gate/up: tile warp / TW on TW warps, as moe_gate_up_staged's CTA.
  const u16* xg = g < T ? x + (size_t)g * K : nullptr;
  const int tile = warp / TW, tw = warp % TW;
  const Nvfp4Staged::Rows rows = Nvfp4Staged::rows(tiles + tile * 9 * K, g, K);
  const int steps = K / Nvfp4Weights::KSTEP;
  float gu[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  bool landed = false;
  for (int s0 = tw; s0 < steps; s0 += TW * NVFP4_UNROLL) {
    Nvfp4Weights::X xv[NVFP4_UNROLL][1];
#pragma unroll
    for (int u = 0; u < NVFP4_UNROLL; ++u) {
      const int s = s0 + u * TW;
      xv[u][0] = xg && s < steps ? Nvfp4Weights::load_x(xg + s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K)
                                 : Nvfp4Weights::zero_x();
    }
    if (!landed) {
      mbarrier_wait_parity(bar_w, 0);
      landed = true;
    }
#pragma unroll
    for (int u = 0; u < NVFP4_UNROLL; ++u) {
      const int s = s0 + u * TW;
      if (s < steps)
        Nvfp4Weights::mma_groups<1>(gu, Nvfp4Staged::load(rows, s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K),
                                    xv[u], sh);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red[tile][(tw * 4 + i) * 32 + (threadIdx.x & 31)] = gu[0][i];
  __syncthreads();
  if (threadIdx.x < 8 * MS_ROWS) {  // (row j, token b): silu(g) * u as bf16, zero past T
    const int j = threadIdx.x >> 3, b = threadIdx.x & 7;
    float v = 0.0f;
    if (b < T) {
      const float gv = tile_sum<TW>(red[j >> 3], j & 7, b) * wg.sum_scale();
      const float uv = tile_sum<TW>(red[j >> 3], (j & 7) + 8, b) * wu.sum_scale();
      v = silu(gv) * uv;
    }
    h_mine[b][j] = f32_to_bf16(v);
  }
  __syncthreads();

  // Each CTA's 8 x 16 values into every CTA's h_chunk [8][MS_CHUNK]: 16 bytes a thread.
  cluster_wait_acquire();
  if (threadIdx.x < 16 * MS_CTAS) {
    const u32 q = threadIdx.x >> 4, b = (threadIdx.x >> 1) & 7, half = threadIdx.x & 1;
    const uint4 v = *reinterpret_cast<const uint4*>(&h_mine[b][8 * half]);
    const u32 at = h_chunk + 2 * (b * MS_CHUNK + rank * MS_ROWS + 8 * half);
    st_async_v4(cluster_map(at, q), v, cluster_map(bar_h, q));
  }
  mbarrier_wait_parity_cluster(bar_h, 0);

  // Down: token g's chunk of h is the mma's x; this lane's products (rows g, g + 8; tokens 2t, 2t + 1)
  // of the tokens that chose the expert into acc.
  Nvfp4Weights::X xd[1];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    xd[0].v[i] = g < T ? lds_v4(h_chunk + 2 * (g * MS_CHUNK + t * Nvfp4Weights::LANE_K + 8 * i))
                       : make_uint4(0, 0, 0, 0);
  const float c_even = coef[2 * t], c_odd = coef[2 * t + 1];
#pragma unroll
  for (int i = 0; i < MS_DOWN_TILES; ++i) {
    const int d = warp + i * W;
    if (d < down_tiles) {
      float part[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
      Nvfp4Weights::mma_groups<1>(part, fd[i], xd, sh);
      long long* row = acc + n_cta + d * 16 + g;
      if (c_even != 0.0f) {  // zero for tokens past T
        red_add_fixed(row + (size_t)(2 * t) * N, c_even * part[0][0]);
        red_add_fixed(row + (size_t)(2 * t) * N + 8, c_even * part[0][2]);
      }
      if (c_odd != 0.0f) {
        red_add_fixed(row + (size_t)(2 * t + 1) * N, c_odd * part[0][1]);
        red_add_fixed(row + (size_t)(2 * t + 1) * N + 8, c_odd * part[0][3]);
      }
    }
  }
}
#endif
