// RMSNorm over rows of H bf16 values, fp32 math, as `rms_norm` in model/reference.py:
//   s = x (+ residual, rounded to bf16 and written to residual_out)
//   out = bf16(s * rsqrt(mean(s^2) + eps) * weight)
// One CTA per row; each thread keeps up to NORM_MAX_VEC 8-wide vectors in registers, so
// H % 8 == 0 and H <= 8 * NORM_MAX_VEC * blockDim.x. In place is allowed (out == x,
// residual_out == residual): every element is read and written by the same thread, with
// ordinary (coherent) loads.
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

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
rmsnorm_bf16(u16* out, u16* residual_out, const u16* x, const u16* residual, const u16* weight,
             int H, float eps) {
  pdl_launch_dependents();
  const size_t base = (size_t)blockIdx.x * H;
  const int num_vec = H / 8;
  uint4 wv[NORM_MAX_VEC];  // the weight is not the previous kernel's: loaded before the wait
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < num_vec) wv[i] = *reinterpret_cast<const uint4*>(weight + 8 * v);
  }
  pdl_wait();
  float s[NORM_MAX_VEC][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= num_vec) break;
    const uint4 xv = *reinterpret_cast<const uint4*>(x + base + 8 * v);
    u32 w[4] = {xv.x, xv.y, xv.z, xv.w};
    if (residual) {
      const uint4 rv = *reinterpret_cast<const uint4*>(residual + base + 8 * v);
      const u32 r[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = pack_bf16x2(bf16x2_lo(w[j]) + bf16x2_lo(r[j]), bf16x2_hi(w[j]) + bf16x2_hi(r[j]));
      *reinterpret_cast<uint4*>(residual_out + base + 8 * v) = make_uint4(w[0], w[1], w[2], w[3]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[i][2 * j] = bf16x2_lo(w[j]);
      s[i][2 * j + 1] = bf16x2_hi(w[j]);
      sum_sq = fmaf(s[i][2 * j], s[i][2 * j], sum_sq);
      sum_sq = fmaf(s[i][2 * j + 1], s[i][2 * j + 1], sum_sq);
    }
  }
  const float inv = rsqrtf(block_sum(sum_sq) / H + eps);
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= num_vec) break;
    const u32 w[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      o[j] = pack_bf16x2(s[i][2 * j] * inv * bf16x2_lo(w[j]), s[i][2 * j + 1] * inv * bf16x2_hi(w[j]));
    *reinterpret_cast<uint4*>(out + base + 8 * v) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}
