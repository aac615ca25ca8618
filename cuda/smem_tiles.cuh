// NVFP4 weight tiles staged in shared memory: each CTA of a one-launch block (moe_fused.cu,
// qkv_fused.cu) bulk-copies the 16-row tiles it will multiply into slots of its shared memory (the
// copy engine: every tile in flight at once, before the wait where the weights allow), then reads
// them as gemv_tile.cuh's fragments and sums them in tile_partial's order (the same bits as the
// kernels that read them from global memory). A slot holds 16 rows of K NVFP4 weights: codes
// [16][code pitch], then block scales [16][scale pitch], the pitches padded so that a warp's
// fragment loads fall in distinct banks. Also the grid-wide counter of such launches.
#pragma once
#include "async_copy.cuh"
#include "gemv_tile.cuh"

struct SlotShape {
  int code_pitch, scale_pitch, bytes;
};

// Codes: rows g and g + 1 of a quarter warp's 16-byte loads 64 bytes apart mod 128; scales: 8 rows
// 16 bytes past a multiple of K/16 apart (K % 256 == 0).
__device__ __forceinline__ SlotShape slot_shape(int K) {
  SlotShape s;
  s.code_pitch = K / 2 + ((K / 2) % 128 == 0 ? 64 : 0);
  s.scale_pitch = K / 16 + 16;
  s.bytes = 16 * (s.code_pitch + s.scale_pitch);
  return s;
}

// Warp-wide: 16 weight rows into a slot, lane r < 16 the codes of row r, lane 16 + r its scales;
// rows 0-7 are the 8 rows from (codes_a, scales_a), rows 8-15 the 8 from (codes_b, scales_b).
// Completes on `bar`, armed here for the bytes.
__device__ __forceinline__ void slot_load(u32 slot, const SlotShape& shape, int K, const u8* codes_a,
                                          const u8* scales_a, const u8* codes_b, const u8* scales_b, u32 bar) {
  const int lane = threadIdx.x & 31, r = lane & 15;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, 16u * (K / 2 + K / 16));
  __syncwarp();
  const int row = r & 7;
  if (lane < 16) {
    const u8* src = (r < 8 ? codes_a : codes_b) + (size_t)row * (K / 2);
    bulk_copy_g2s(slot + r * shape.code_pitch, src, K / 2, bar);
  } else {
    const u8* src = (r < 8 ? scales_a : scales_b) + (size_t)row * (K / 16);
    bulk_copy_g2s(slot + 16 * shape.code_pitch + r * shape.scale_pitch, src, K / 16, bar);
  }
}

// Warp-wide: rows n0 .. n0 + 15 of a weight [N, K] (n0 + 16 <= N) into a slot.
__device__ __forceinline__ void slot_load_rows(u32 slot, const SlotShape& shape, const Nvfp4Weights& w, int n0, int K,
                                               u32 bar) {
  const u8* codes = w.codes + (size_t)n0 * (K / 2);
  const u8* scales = w.scales + (size_t)n0 * (K / 16);
  slot_load(slot, shape, K, codes, scales, codes + 8 * (K / 2), scales + 8 * (K / 16), bar);
}

// Rows g and g + 8 of a slot at weights k .. k + 31: the fragment Nvfp4Weights::load reads.
__device__ __forceinline__ Nvfp4Frag slot_frag(u32 slot, const SlotShape& shape, int g, int k) {
  const u32 codes = slot + g * shape.code_pitch + k / 2;
  const u32 scales = slot + 16 * shape.code_pitch + g * shape.scale_pitch + k / 16;
  return {lds_v4(codes), lds_v4(codes + 8 * shape.code_pitch), lds_u16(scales), lds_u16(scales + 8 * shape.scale_pitch)};
}

__device__ __forceinline__ Nvfp4Weights::X lds_x(u32 addr) {
  Nvfp4Weights::X x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.v[i] = lds_v4(addr + 16 * i);
  return x;
}

// acc += warp w's share of the slot's 16-row tile . token g's row (x_row in shared memory; 0: none):
// k-steps w, w + W, ... in order, as warp w of a W-warp CTA in tile_partial<Nvfp4Weights, W, U>
// (gemv_tile.cuh) sums them from global memory, so the same bits.
template <int W, int U>
__device__ __forceinline__ void slot_partial(float (&acc)[4], u32 slot, const SlotShape& shape, u32 x_row, int K,
                                             int w, const Nvfp4Weights::Shared& sh) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int steps = K / Nvfp4Weights::KSTEP;
  for (int s0 = w; s0 < steps; s0 += W * U) {
    Nvfp4Frag f[U];
    Nvfp4Weights::X xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load of the round first
      const int s = s0 + u * W, k = s * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K;
      f[u] = s < steps ? slot_frag(slot, shape, g, k) : Nvfp4Weights::zero();
      xv[u] = s < steps && x_row ? lds_x(x_row + 2 * k) : Nvfp4Weights::zero_x();
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (s0 + u * W < steps) Nvfp4Weights::mma(acc, f[u], xv[u], sh);
  }
}

// Token g's activations of a k-step written by other CTAs of this launch: from L2.
__device__ __forceinline__ Nvfp4Weights::X ld_cg_x(const u16* p) {
  Nvfp4Weights::X x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.v[i] = ld_cg_v4(p + 8 * i);
  return x;
}

// ---- the same blocks reading their weights from global memory ---------------------------------

// NVFP4: n tensor scales (experts, or the row parts of one weight) copied into shared memory before
// the wait, w pointing there, so that no sum scale costs an L2 round trip after it. BF16: none.
__device__ __forceinline__ void stage_tensor_scales(Nvfp4Weights& w, float* dst, int n) {
  for (int e = threadIdx.x; e < n; e += blockDim.x) dst[e] = w.tensor_scale[e];
  w.tensor_scale = dst;
}
__device__ __forceinline__ void stage_tensor_scales(Bf16Weights&, float*, int) {}

// Token g's activations of a k-step: from shared memory, or written by other CTAs of this launch (L2).
template <class Wt>
__device__ __forceinline__ typename Wt::X lds_x_of(u32 addr);
template <>
__device__ __forceinline__ Nvfp4Weights::X lds_x_of<Nvfp4Weights>(u32 addr) { return lds_x(addr); }
template <>
__device__ __forceinline__ uint4 lds_x_of<Bf16Weights>(u32 addr) { return lds_v4(addr); }
template <class Wt>
__device__ __forceinline__ typename Wt::X ld_cg_x_of(const u16* p);
template <>
__device__ __forceinline__ Nvfp4Weights::X ld_cg_x_of<Nvfp4Weights>(const u16* p) { return ld_cg_x(p); }
template <>
__device__ __forceinline__ uint4 ld_cg_x_of<Bf16Weights>(const u16* p) { return ld_cg_v4(p); }

// acc += warp w's share of a tile read from global memory (rows) . token g's row in shared memory:
// tile_partial<Wt, W, U> (gemv_tile.cuh) with the activations from shared memory, the same bits.
template <class Wt, int W, int U>
__device__ __forceinline__ void global_partial(float (&acc)[4], const typename Wt::Rows& rows, u32 x_row, int K,
                                               int w, const typename Wt::Shared& sh) {
  const int t = threadIdx.x & 3;
  const int steps = K / Wt::KSTEP;
  for (int s0 = w; s0 < steps; s0 += W * U) {
    typename Wt::Frag f[U];
    typename Wt::X xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every weight load of the round first
      const int s = s0 + u * W, k = s * Wt::KSTEP + t * Wt::LANE_K;
      f[u] = s < steps ? Wt::load(rows, k) : Wt::zero();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * W, k = s * Wt::KSTEP + t * Wt::LANE_K;
      xv[u] = s < steps && x_row ? lds_x_of<Wt>(x_row + 2 * k) : Wt::zero_x();
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (s0 + u * W < steps) Wt::mma(acc, f[u], xv[u], sh);
  }
}

// Thread 0 of each CTA, after a __syncthreads that follows the CTA's stores the others will read:
// returns once all C CTAs of the grid have arrived (every CTA must be resident: the host sizes the
// grid from the occupancy); the last one to leave zeroes both counters for the next launch.
__device__ __forceinline__ void grid_barrier(int* counters, int C) {
  ticket_arrive(reinterpret_cast<u32*>(counters));
  u64 start = 0;
  for (u32 spins = 1; ld_acquire_gpu(counters) < C; ++spins) {
    if (spins % 4096 == 0) {  // a CTA that never came (the grid not resident): an error, not a hang
      u64 now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (!start) start = now;
      if (now - start > 10000000000ull) __trap();
    }
  }
  ticket_acquire();
  if (atomicAdd(counters + 1, 1) == C - 1) {
    counters[0] = 0;
    counters[1] = 0;
  }
}
