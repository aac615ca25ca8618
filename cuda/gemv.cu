// Dense skinny GEMMs for B <= 8 * GEMV_GROUPS tokens: y[B, N] = x[B, K] . W[N, K]^T (+ residual),
// and the SwiGLU front half h[B, I] = silu(x . Wg^T) * (x . Wu^T). x, y, h, residual: bf16
// row-major, contiguous (gemv_bf16_f32: y fp32, no residual: the router's logits); W: bf16 or
// NVFP4 (gemv_tile.cuh). One CTA of GEMV_WARPS warps per 16 output rows (8 for gate/up: tile rows
// 0-7 read Wg, rows 8-15 read Wu), whole K per CTA, no atomics. y may alias residual (each element is read and written by the same thread). NVFP4 W may
// be up to three weights stacked by rows, each with its tensor scale: rows [split1, split2) use
// tensor_scale[1], rows from split2 on tensor_scale[2] (q/k/v as one GEMV).
// Before waiting on the previous kernel (PDL), each CTA asks for its weight rows in L2 and issues
// its first round of weight loads.
// GEMV_WARPS (4, 8 or 16) is a compile-time define: few tiles want more warps splitting K, so
// that each SM keeps enough loads in flight. GEMV_GROUPS (1-4): 8-token groups; tokens 8g..8g+7
// are mma column group g, every group fed by the same decoded weights (3-4 groups: at most 8
// warps, kernels/linear.py gemv_warps).
// gemv_*_argmax (the LM head of a decode step): also ids[b] = argmax_n y[b, n] of y as stored, with
// argmax.cu's order, without a second pass over y: each CTA's best of its 16 rows goes to best[b]
// by atomicMax on the packed candidate (argmax.cuh), and the last CTA to take the ticket writes
// the ids and zeroes best and the ticket for the next launch (graph replays). Where *active is 0
// (every row samples) only y is written.
#include "argmax.cuh"
#include "gemv_tile.cuh"
#include "norm.cuh"  // norm_unpack

#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#ifndef GEMV_GROUPS
#define GEMV_GROUPS 1
#endif
#define BF16_UNROLL 8   // k-steps in flight per warp: 8 x 1 KB
#define NVFP4_UNROLL 4  // 4 x (1 KB codes + scales)
#define GEMV_RED (GEMV_WARPS * 4 * 32)  // partials of one group

// acc[grp] over all of K for this CTA's rows; token grp * 8 + g feeds lane g of group grp.
// norm_w (NORM): x times it on load (the RMSNorm's weight; gemv scales by the inverse RMS after).
template <class Wt, int U, bool NORM = false>
__device__ __forceinline__ void gemv_partials(float* red, const typename Wt::Rows& rows, const u16* x,
                                              int B, int K, const typename Wt::Shared& sh,
                                              const u16* norm_w = nullptr) {
  const int g = (threadIdx.x & 31) >> 2;
  const u16* xs[GEMV_GROUPS];
#pragma unroll
  for (int grp = 0; grp < GEMV_GROUPS; ++grp) xs[grp] = grp * 8 + g < B ? x + (size_t)(grp * 8 + g) * K : nullptr;
  float acc[GEMV_GROUPS][4] = {};
  tile_partial_groups<Wt, GEMV_WARPS, U, true, GEMV_GROUPS, NORM>(acc, rows, xs, K, 0,
                                                                 (K + Wt::KSTEP - 1) / Wt::KSTEP, sh, norm_w);
#pragma unroll
  for (int grp = 0; grp < GEMV_GROUPS; ++grp) tile_store_partials<GEMV_WARPS>(red + grp * GEMV_RED, acc[grp]);
  __syncthreads();
}

// NORM: y = rms_norm(x, norm_w) . W^T (model/reference.py's rms_norm, then the GEMV) without the
// norm's launch: x times norm_w on load, the sums times each row's inverse RMS, which the CTA takes
// from x itself after its k-loop (the rows are in L1 / L2 by then). Roundings differ from the two
// launches' (x * w rounded to bf16 instead of x * inv_rms * w): within bf16 tolerance, not equal.
// Where the LM head's folded argmax goes (gemv_*_argmax): best [B] and ticket zero between launches.
struct Pick {
  u64* best;
  u32* ticket;
  void* ids;
  int ids_int64;
  const int* active;
};

// Threads 0-127 (every one, a named barrier), each with its candidates of tokens grp * 8 + (lane & 7)
// over its row: the CTA's best of each token into pick.best, then the ticket; the last CTA writes
// the ids and resets best and the ticket.
__device__ __forceinline__ void pick_tokens(const u64 (&cand)[GEMV_GROUPS], int B, const Pick& pick) {
  __shared__ u32 is_last;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int grp = 0; grp < GEMV_GROUPS; ++grp) {  // a warp's 4 rows of one token: lanes j, j + 8, j + 16, j + 24
    u64 c = cand[grp];
    c = u64_max(c, __shfl_xor_sync(0xFFFFFFFFu, c, 8));
    c = u64_max(c, __shfl_xor_sync(0xFFFFFFFFu, c, 16));
    const int b = grp * 8 + lane;
    if (lane < 8 && b < B && c != 0ull) atomicMax(pick.best + b, c);
  }
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (threadIdx.x == 0) is_last = ticket_arrive(pick.ticket) == gridDim.x - 1;
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (!is_last) return;
  ticket_acquire();
  if (threadIdx.x < B) {
    const u64 m = atomicExch(pick.best + threadIdx.x, 0ull);
    const u32 index = 0xFFFFFFFFu - (u32)(m & 0xFFFFFFFFu);
    if (pick.ids_int64)
      static_cast<long long*>(pick.ids)[threadIdx.x] = index;
    else
      static_cast<int*>(pick.ids)[threadIdx.x] = (int)index;
  }
  if (threadIdx.x == 0) *pick.ticket = 0u;
}

template <class Wt, int U, class Out = u16, bool NORM = false, bool ARGMAX = false>
__device__ __forceinline__ void gemv(int tile, Out* y, const u16* x, const Wt& wt, const u16* residual,
                                     int B, int N, int K, int split1, int split2,
                                     const u16* norm_w = nullptr, float eps = 0.0f, const Pick& pick = {}) {
  __shared__ float red[GEMV_GROUPS * GEMV_RED];
  __shared__ typename Wt::Shared sh;
  __shared__ float inv_rms[NORM ? 8 * GEMV_GROUPS : 1];
  Wt::init_shared(sh);
  pdl_launch_dependents();
  __syncthreads();
  const int g = (threadIdx.x & 31) >> 2;
  const int n0 = tile * 16;
  if (threadIdx.x == 0) wt.prefetch(n0, min(16, N - n0), K);
  const typename Wt::Rows rows = Wt::rows(wt, min(n0 + g, N - 1), wt, min(n0 + g + 8, N - 1), K);
  gemv_partials<Wt, U, NORM>(red, rows, x, B, K, sh, norm_w);
  if constexpr (NORM) {  // warp w: rows w, w + GEMV_WARPS, ..; K % 8 == 0
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int b = warp; b < B; b += GEMV_WARPS) {
      float sum_sq = 0.0f;
      for (int k = 8 * lane; k < K; k += 256) {
        const uint4 v = ld_act_v4(x + (size_t)b * K + k);
        const u32 w4[4] = {v.x, v.y, v.z, v.w};
        float unpacked[8];
        sum_sq = norm_unpack(unpacked, w4, sum_sq);
      }
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) inv_rms[b] = rsqrtf(sum_sq / K + eps);
    }
    __syncthreads();
  }
  const int r = threadIdx.x >> 3, n = n0 + r;  // threads 0..127: 16 rows x 8 tokens of a group
  if (r >= 16 || (!ARGMAX && n >= N)) return;
  [[maybe_unused]] u64 cand[GEMV_GROUPS] = {};  // ARGMAX: y[b, n] as stored, packed with n
#pragma unroll
  for (int grp = 0; grp < GEMV_GROUPS; ++grp) {
    const int j = threadIdx.x & 7, b = grp * 8 + j;
    if (b >= B || (ARGMAX && n >= N)) break;
    float v = tile_sum<GEMV_WARPS>(red + grp * GEMV_RED, r, j) * wt.sum_scale((n >= split1) + (n >= split2));
    if constexpr (NORM) v *= inv_rms[b];
    if (residual) v += bf16_to_f32(residual[(size_t)b * N + n]);
    if constexpr (sizeof(Out) == 4) {
      y[(size_t)b * N + n] = v;
    } else {
      const u16 stored = f32_to_bf16(v);
      y[(size_t)b * N + n] = stored;
      v = bf16_to_f32(stored);
    }
    if constexpr (ARGMAX) cand[grp] = argmax_candidate(v, n);
  }
  if constexpr (ARGMAX) {
    if (!pick.active || *pick.active != 0) pick_tokens(cand, B, pick);
  }
}

template <class Wt, int U>
__device__ __forceinline__ void gate_up(int tile, u16* h, const u16* x, const Wt& wg, const Wt& wu, int B,
                                        int I, int K) {
  __shared__ float red[GEMV_GROUPS * GEMV_RED];
  __shared__ typename Wt::Shared sh;
  Wt::init_shared(sh);
  pdl_launch_dependents();
  __syncthreads();
  const int g = (threadIdx.x & 31) >> 2;
  const int j0 = tile * 8;
  if (threadIdx.x == 0) wg.prefetch(j0, min(8, I - j0), K);
  if (threadIdx.x == 32) wu.prefetch(j0, min(8, I - j0), K);
  const int row = min(j0 + g, I - 1);
  gemv_partials<Wt, U>(red, Wt::rows(wg, row, wu, row, K), x, B, K, sh);
  const int j = threadIdx.x >> 3, n = j0 + j;
  if (j >= 8 || n >= I) return;
#pragma unroll
  for (int grp = 0; grp < GEMV_GROUPS; ++grp) {
    const int c = threadIdx.x & 7, b = grp * 8 + c;
    if (b >= B) break;
    const float gate = tile_sum<GEMV_WARPS>(red + grp * GEMV_RED, j, c) * wg.sum_scale();
    const float up = tile_sum<GEMV_WARPS>(red + grp * GEMV_RED, j + 8, c) * wu.sum_scale();
    h[(size_t)b * I + n] = f32_to_bf16(silu(gate) * up);
  }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16(u16* y, const u16* x, const u16* w, const u16* residual, int B, int N, int K) {
  gemv<Bf16Weights, BF16_UNROLL>(blockIdx.x, y, x, Bf16Weights{w}, residual, B, N, K, N, N);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_f32(float* y, const u16* x, const u16* w, int B, int N, int K) {
  gemv<Bf16Weights, BF16_UNROLL>(blockIdx.x, y, x, Bf16Weights{w}, nullptr, B, N, K, N, N);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_nvfp4(u16* y, const u16* x, const u8* codes, const u8* scales, const float* tensor_scale,
           const u16* residual, int B, int N, int K, int split1, int split2) {
  gemv<Nvfp4Weights, NVFP4_UNROLL>(blockIdx.x, y, x, Nvfp4Weights{codes, scales, tensor_scale}, residual, B, N, K,
                                   split1, split2);
}

// The LM head with the greedy choice folded in (see Pick)
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_argmax(u16* y, const u16* x, const u16* w, int B, int N, int K, u64* best, u32* ticket, void* ids,
                 int ids_int64, const int* active) {
  gemv<Bf16Weights, BF16_UNROLL, u16, false, true>(blockIdx.x, y, x, Bf16Weights{w}, nullptr, B, N, K, N, N, nullptr,
                                                   0.0f, Pick{best, ticket, ids, ids_int64, active});
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_nvfp4_argmax(u16* y, const u16* x, const u8* codes, const u8* scales, const float* tensor_scale, int B, int N,
                  int K, u64* best, u32* ticket, void* ids, int ids_int64, const int* active) {
  gemv<Nvfp4Weights, NVFP4_UNROLL, u16, false, true>(blockIdx.x, y, x, Nvfp4Weights{codes, scales, tensor_scale},
                                                     nullptr, B, N, K, N, N, nullptr, 0.0f,
                                                     Pick{best, ticket, ids, ids_int64, active});
}

// rms_norm(x, norm_w, eps) . W^T in one launch (see gemv's NORM)
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_norm(u16* y, const u16* x, const u16* w, const u16* residual, int B, int N, int K, const u16* norm_w,
               float eps) {
  gemv<Bf16Weights, BF16_UNROLL, u16, true>(blockIdx.x, y, x, Bf16Weights{w}, residual, B, N, K, N, N, norm_w, eps);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_nvfp4_norm(u16* y, const u16* x, const u8* codes, const u8* scales, const float* tensor_scale,
                const u16* residual, int B, int N, int K, int split1, int split2, const u16* norm_w, float eps) {
  gemv<Nvfp4Weights, NVFP4_UNROLL, u16, true>(blockIdx.x, y, x, Nvfp4Weights{codes, scales, tensor_scale}, residual, B, N, K,
                                              split1, split2, norm_w, eps);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gate_up_bf16(u16* h, const u16* x, const u16* wg, const u16* wu, int B, int I, int K) {
  gate_up<Bf16Weights, BF16_UNROLL>(blockIdx.x, h, x, Bf16Weights{wg}, Bf16Weights{wu}, B, I, K);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gate_up_nvfp4(u16* h, const u16* x, const u8* g_codes, const u8* g_scales, const float* g_tensor_scale,
              const u8* u_codes, const u8* u_scales, const float* u_tensor_scale, int B, int I, int K) {
  gate_up<Nvfp4Weights, NVFP4_UNROLL>(blockIdx.x, h, x, Nvfp4Weights{g_codes, g_scales, g_tensor_scale},
                                      Nvfp4Weights{u_codes, u_scales, u_tensor_scale}, B, I, K);
}
