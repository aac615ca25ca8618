// What the small-batch expert kernels share (moe.cu: gate/up then down; moe_split.cu: both in one
// launch): which expert a (token, slot) pair names, and the k-loops' unrolls.
#pragma once
#include "gemv_tile.cuh"

#define MOE_MAX_PAIRS 64  // T * A
#define BF16_UNROLL 8
#define NVFP4_UNROLL 4

// The slot of token b that chose expert e among its A (e < 0: the shared expert, slot A), or -1.
__device__ __forceinline__ int moe_slot_of(const int* pair_expert, int b, int A, int e) {
  int slot = e < 0 ? A : -1;
  for (int s = 0; s < A && slot < 0; ++s)
    if (pair_expert[b * A + s] == e) slot = s;
  return slot;
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

// One thread: a staged 16-row tile of rows j0..j0 + 7 of gate (tile rows 0-7) and of up (8-15), the
// layout moe_staged_tile_partial reads; 9 K bytes completing on bar (whose expected bytes the caller sets).
__device__ __forceinline__ void moe_stage_tile(u32 tile, const Nvfp4Weights& wg, const Nvfp4Weights& wu, int j0,
                                               int K, u32 bar) {
  Nvfp4Staged::copy_rows(tile, 0, wg, j0, 8, K, bar);
  Nvfp4Staged::copy_rows(tile, 8, wu, j0, 8, K, bar);
}

// One warp's partial sums of a staged 16-row tile (`rows`: its codes and scales in shared memory,
// landing on bar_w) against token g's x (xg, or nullptr past the batch): k-steps tw, tw + TW, ...
// of K / KSTEP. The round's x is loaded before the first wait, so its L2 trips overlap the copies.
template <int TW>
__device__ __forceinline__ void moe_staged_tile_partial(float (&acc)[1][4], const Nvfp4Staged::Rows& rows,
                                                        const u16* xg, int tw, int t, int K, u32 bar_w,
                                                        const Nvfp4Weights::Shared& sh) {
  const int steps = K / Nvfp4Weights::KSTEP;
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
        Nvfp4Weights::mma_groups<1>(acc, Nvfp4Staged::load(rows, s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K),
                                    xv[u], sh);
    }
  }
}
