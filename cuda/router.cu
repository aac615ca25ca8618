// Sigmoid top-k router for T <= 8 tokens, matching `route()` in model/reference.py:
//   logits = x . gate^T (fp32 sums), scores = sigmoid(logits), chosen = top-A of (scores + bias),
//   weights = scores[chosen] / sum(scores[chosen]) * scaling; ids and weights in descending order
//   of score + bias (ties: lower expert id).
// Grid (E/16 row tiles, K splits): each CTA writes fp32 partial logits to `partial`
// [splits][T][E]; the last CTA to take a ticket sums them in split order (deterministic), selects,
// and resets the ticket to 0 so that the kernel replays in a CUDA graph. ROUTER_MAX_EXPERTS
// (256 or 1024) is a compile-time define.
#include "gemv_tile.cuh"

#define ROUTER_WARPS 8
#define ROUTER_UNROLL 4
#define ROUTER_MAX_SPLITS 8  // kernels/moe.py MAX_ROUTER_SPLITS
#ifndef ROUTER_MAX_EXPERTS
#define ROUTER_MAX_EXPERTS 256  // a compile-time define: 32 per lane at most
#endif
#define ROUTER_PER_LANE (ROUTER_MAX_EXPERTS / 32)

// One warp: top-A of scores[e] + bias[e] over E <= ROUTER_MAX_EXPERTS experts; lane owns experts
// lane + 32 i, held in registers (unrolled loops: no local memory). Taken ones become -inf.
__device__ __forceinline__ void router_select(int* ids, float* weights, const float* scores,
                                              const float* bias, int E, int A, float scaling) {
  const float neg_inf = -__int_as_float(0x7F800000);
  const int lane = threadIdx.x & 31;
  float sel[ROUTER_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROUTER_PER_LANE; ++i) {
    const int e = lane + 32 * i;
    sel[i] = e < E ? scores[e] + bias[e] : neg_inf;
  }
  int my_id = 0;
  float my_weight = 0.0f;
  for (int j = 0; j < A; ++j) {
    float best = neg_inf;
    int best_i = 0;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i)
      if (sel[i] > best) {  // strict: the lowest i (lowest expert id of this lane) wins ties
        best = sel[i];
        best_i = i;
      }
    int best_e = best > neg_inf ? lane + 32 * best_i : 0x7FFFFFFF;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      const float ov = __shfl_xor_sync(0xFFFFFFFFu, best, m);
      const int oe = __shfl_xor_sync(0xFFFFFFFFu, best_e, m);
      if (ov > best || (ov == best && oe < best_e)) {
        best = ov;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane) {
#pragma unroll
      for (int i = 0; i < ROUTER_PER_LANE; ++i)
        if (i == (best_e >> 5)) sel[i] = neg_inf;
    }
    if (lane == j) {
      my_id = best_e;
      my_weight = scores[best_e];
    }
  }
  const float total = warp_sum(lane < A ? my_weight : 0.0f);
  if (lane < A) {
    ids[lane] = my_id;
    weights[lane] = my_weight / total * scaling;
  }
}

extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk(int* ids, float* weights, const u16* x, const u16* gate, const float* bias,
            float* partial, u32* ticket, int T, int E, int K, int A, float scaling) {
  __shared__ float red[ROUTER_WARPS * 4 * 32];
  __shared__ Bf16Weights::Shared sh;
  __shared__ u32 is_last;
  extern __shared__ float scores[];  // [T][E], last CTA only
  pdl_launch_dependents();
  const int g = (threadIdx.x & 31) >> 2, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * 16, split = blockIdx.y, splits = gridDim.y;
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
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
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
