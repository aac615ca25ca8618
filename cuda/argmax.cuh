// The order of a greedy choice, shared by argmax.cu and the LM head's folded argmax (gemv.cu):
// a value and its index packed so that the larger u64 is the better candidate, exactly as
// torch.argmax chooses (ties and NaN: the lowest index; a NaN counts as the maximum; -0 == +0).
//   (order_key(value) << 32) | (0xFFFFFFFF - index)      0: no candidate (below every value's key)
#pragma once
#include "common.cuh"

__device__ __forceinline__ u64 argmax_candidate(float v, int index) {
  u32 u = __float_as_uint(v);
  if (v == 0.0f) u = 0u;  // -0 ties with +0
  u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  if (v != v) key = 0xFFFFFFFFu;
  return ((u64)key << 32) | (u64)(0xFFFFFFFFu - (u32)index);
}

__device__ __forceinline__ u64 u64_max(u64 a, u64 b) { return a > b ? a : b; }

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = u64_max(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}
