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
