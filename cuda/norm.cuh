// RMSNorm of one row per CTA, as `rms_norm` in model/reference.py (fp32 math over the bf16 row):
//   out = bf16(s * rsqrt(mean(s^2) + eps) * weight)
// Each thread holds up to NORM_MAX_VEC 8-wide vectors of the row (vector v = threadIdx.x + i *
// blockDim.x), so H % 8 == 0 and H <= 8 * NORM_MAX_VEC * blockDim.x. Shared by rmsnorm.cu and the
// kernels that produce a row and normalize it in the same pass (moe_routing.cu's finalize).
#pragma once
#include "common.cuh"

#define NORM_MAX_THREADS 256
#define NORM_MAX_VEC 4

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_part[NORM_MAX_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += warp_part[w];  // same order in every thread
  return total;
}

// The weight is never the previous kernel's output: load it before pdl_wait. V: each thread stands
// for V threads of a CTA V times as large, threadIdx.x + j * blockDim.x (norm_rows_shared), their
// vectors at wv[j * NORM_MAX_VEC + i].
template <int V = 1>
__device__ __forceinline__ void norm_weight_load(uint4 (&wv)[V * NORM_MAX_VEC], const u16* weight, int num_vec) {
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int i = 0; i < NORM_MAX_VEC; ++i) {
      const int v = threadIdx.x + j * blockDim.x + i * V * blockDim.x;
      if (v < num_vec) wv[j * NORM_MAX_VEC + i] = *reinterpret_cast<const uint4*>(weight + 8 * v);
    }
}

// s[i][0..7] <- the 8 values of bf16 words w; returns sum_sq + their squares (in order).
__device__ __forceinline__ float norm_unpack(float (&s)[8], const u32 (&w)[4], float sum_sq) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    s[2 * j] = bf16x2_lo(w[j]);
    s[2 * j + 1] = bf16x2_hi(w[j]);
    sum_sq = fmaf(s[2 * j], s[2 * j], sum_sq);
    sum_sq = fmaf(s[2 * j + 1], s[2 * j + 1], sum_sq);
  }
  return sum_sq;
}

// Every thread of the CTA: out_row[v] = bf16(s * inv_rms * weight) for its vectors.
__device__ __forceinline__ void norm_store(u16* out_row, const float (&s)[NORM_MAX_VEC][8],
                                           const uint4 (&wv)[NORM_MAX_VEC], float sum_sq, int H,
                                           float eps) {
  const float inv = rsqrtf(block_sum(sum_sq) / H + eps);
  const int num_vec = H / 8;
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= num_vec) break;
    const u32 w[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      o[j] = pack_bf16x2(s[i][2 * j] * inv * bf16x2_lo(w[j]), s[i][2 * j + 1] * inv * bf16x2_hi(w[j]));
    *reinterpret_cast<uint4*>(out_row + 8 * v) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Every thread of the CTA: rows x [T][K] (bf16, written by the previous kernel: after the wait) into
// x_smem [T][pitch], 16 bytes a load; then a barrier. The rows norm_rows_shared normalizes.
__device__ __forceinline__ void stage_rows_shared(unsigned char* x_smem, int pitch, const u16* x, int T, int K) {
  for (int i = threadIdx.x; i < T * (K / 8); i += blockDim.x) {
    const int b = i / (K / 8), c = i - b * (K / 8);
    *reinterpret_cast<uint4*>(x_smem + b * pitch + 16 * c) = ld_act_v4(x + (size_t)b * K + 8 * c);
  }
  __syncthreads();
}

// Rows x_smem [T][pitch] (bf16, raw, T <= 8) become rms_norm(x, weight) in place, with rmsnorm.cu's
// arithmetic in its order (a thread's vectors v = threadIdx.x + i * 256 summed with norm_unpack, then
// warp_sum, then the warps in order: the bits of `rms_norm`'s launch, whose CTA has 256 threads, or
// fewer whose missing warps add exact zeros here). Every thread of the CTA calls it; its
// blockDim.x * V threads are those 256 (V: each thread stands for threadIdx.x + j * blockDim.x,
// j < V, and holds their weights as norm_weight_load<V> loads them). WRITE: vectors v % parts ==
// part of each row are also stored to `normed` [T][K] (the CTAs of a cluster writing the rows out
// between them).
template <bool WRITE = true, int V = 1>
__device__ __forceinline__ void norm_rows_shared(unsigned char* x_smem, int pitch, const uint4 (&wv)[V * NORM_MAX_VEC],
                                                 u16* normed, int part, int parts, int T, int K, float eps) {
  __shared__ float warp_sums[8][NORM_MAX_THREADS / 32];
  const int num_vec = K / 8, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, threads = V * blockDim.x;
  for (int b = 0; b < T; ++b) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float sum_sq = 0.0f;
#pragma unroll
      for (int i = 0; i < NORM_MAX_VEC; ++i) {
        const int v = threadIdx.x + j * blockDim.x + i * threads;
        if (v >= num_vec) break;
        const uint4 xv = *reinterpret_cast<const uint4*>(x_smem + b * pitch + 16 * v);
        const u32 w[4] = {xv.x, xv.y, xv.z, xv.w};
        float s[8];
        sum_sq = norm_unpack(s, w, sum_sq);
      }
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) warp_sums[b][warp + j * (blockDim.x >> 5)] = sum_sq;
    }
  }
  __syncthreads();
  for (int b = 0; b < T; ++b) {
    float total = 0.0f;
    for (int w = 0; w < NORM_MAX_THREADS / 32; ++w) total += warp_sums[b][w];
    const float inv = rsqrtf(total / K + eps);
#pragma unroll
    for (int j = 0; j < V; ++j)
#pragma unroll
      for (int i = 0; i < NORM_MAX_VEC; ++i) {
        const int v = threadIdx.x + j * blockDim.x + i * threads;
        if (v >= num_vec) break;
        uint4* at = reinterpret_cast<uint4*>(x_smem + b * pitch + 16 * v);
        const uint4 xv = *at, wvi = wv[j * NORM_MAX_VEC + i];
        const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w}, ww[4] = {wvi.x, wvi.y, wvi.z, wvi.w};
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          o[k] = pack_bf16x2(bf16x2_lo(xw[k]) * inv * bf16x2_lo(ww[k]), bf16x2_hi(xw[k]) * inv * bf16x2_hi(ww[k]));
        *at = make_uint4(o[0], o[1], o[2], o[3]);
        if (WRITE && v % parts == part) *reinterpret_cast<uint4*>(normed + (size_t)b * K + 8 * v) = *at;
      }
  }
  __syncthreads();
}
