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
#include "moe_experts.cuh"

#ifndef MOE_GATE_UP_WARPS
#define MOE_GATE_UP_WARPS 4  // a compile-time define: 8 for bf16 (one round of loads per warp)
#endif
#ifndef MOE_DOWN_WARPS
#define MOE_DOWN_WARPS 16  // a define: cuda/decode_step.cu runs the body on 8
#endif
#define MOE_DOWN_PREFETCH_EXPERTS 8

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
    moe_stage_tile(tile, wg, wu, j0, K, bar_w);
  }
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const u16* xg = g < T ? x + (size_t)g * K : nullptr;
  float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  moe_staged_tile_partial<MOE_GATE_UP_WARPS>(acc, Nvfp4Staged::rows(tile, g, K), xg, warp, t, K, bar_w, sh);
  moe_gate_up_store(red, acc[0], h, pair_expert, e, wg.sum_scale(), wu.sum_scale(), j0, T, A, I);
}
#endif
