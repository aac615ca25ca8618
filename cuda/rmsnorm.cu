// RMSNorm over rows of H bf16 values (norm.cuh), optionally after a residual add:
//   rmsnorm_bf16:    s = x (+ residual, rounded to bf16 and written to residual_out)
//   add_rmsnorm_f32: s = bf16(x + residual) with x fp32 (a GEMM's fp32 product; one rounding of
//                    the sum, as torch.add(x, residual, out=bf16)), written to residual_out; x may
//                    come as `parts` split-K partial products [parts][rows][H], added in order first
//   add_rmsnorm_fixed: the same with x fixed point (common.cuh red_add_fixed: moe_split.cu's
//                    sum), zeroed once read for the next sum
//   out = bf16(s * rsqrt(mean(s^2) + eps) * weight)
// One CTA per row. In place is allowed (out == x, residual_out == residual): every element is
// read and written by the same thread, with ordinary (coherent) loads.
#include "norm.cuh"

#define MAX_NORM_PARTS 4  // kernels/norm.py MAX_PARTS

// The 8 values of s at element `at`, as bf16 words.
__device__ __forceinline__ void load_sum(u32 (&w)[4], const u16* x, const u16* residual, size_t at) {
  const uint4 xv = *reinterpret_cast<const uint4*>(x + at);
  w[0] = xv.x, w[1] = xv.y, w[2] = xv.z, w[3] = xv.w;
  if (!residual) return;
  const uint4 rv = *reinterpret_cast<const uint4*>(residual + at);
  const u32 r[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = pack_bf16x2(bf16x2_lo(w[j]) + bf16x2_lo(r[j]), bf16x2_hi(w[j]) + bf16x2_hi(r[j]));
}

// x: `parts` partial products part_stride apart (every part's loads issued before the first add).
__device__ __forceinline__ void load_sum(u32 (&w)[4], const float* x, int parts, size_t part_stride,
                                         const u16* residual, size_t at) {
  float4 p[MAX_NORM_PARTS][2];
#pragma unroll
  for (int q = 0; q < MAX_NORM_PARTS; ++q)
    if (q == 0 || q < parts) {
      p[q][0] = *reinterpret_cast<const float4*>(x + q * part_stride + at);
      p[q][1] = *reinterpret_cast<const float4*>(x + q * part_stride + at + 4);
    }
  float xs[8] = {p[0][0].x, p[0][0].y, p[0][0].z, p[0][0].w, p[0][1].x, p[0][1].y, p[0][1].z, p[0][1].w};
#pragma unroll
  for (int q = 1; q < MAX_NORM_PARTS; ++q)
    if (q < parts) {
      xs[0] += p[q][0].x, xs[1] += p[q][0].y, xs[2] += p[q][0].z, xs[3] += p[q][0].w;
      xs[4] += p[q][1].x, xs[5] += p[q][1].y, xs[6] += p[q][1].z, xs[7] += p[q][1].w;
    }
  const uint4 rv = *reinterpret_cast<const uint4*>(residual + at);
  const u32 r[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = pack_bf16x2(xs[2 * j] + bf16x2_lo(r[j]), xs[2 * j + 1] + bf16x2_hi(r[j]));
}

// x fixed point (value x 2^32), each element zeroed once read.
__device__ __forceinline__ void load_sum(u32 (&w)[4], const long long* x, const u16* residual, size_t at) {
  longlong2* xv = reinterpret_cast<longlong2*>(const_cast<long long*>(x) + at);
  longlong2 p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = xv[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) xv[i] = make_longlong2(0, 0);
  const uint4 rv = *reinterpret_cast<const uint4*>(residual + at);
  const u32 r[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = pack_bf16x2(fixed_to_f32(p[j].x) + bf16x2_lo(r[j]), fixed_to_f32(p[j].y) + bf16x2_hi(r[j]));
}

// Row `row` of `rows` (x's parts are rows * H apart).
template <class X>
__device__ __forceinline__ void add_norm_row(int row, int rows, u16* out, u16* residual_out, const X* x, const u16* residual,
                                             const u16* weight, int H, float eps, int parts = 1) {
  pdl_launch_dependents();
  const size_t base = (size_t)row * H;
  const int num_vec = H / 8;
  uint4 wv[NORM_MAX_VEC];
  norm_weight_load(wv, weight, num_vec);
  pdl_wait();
  float s[NORM_MAX_VEC][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= num_vec) break;
    u32 w[4];
    if constexpr (sizeof(X) == 8)
      load_sum(w, x, residual, base + 8 * v);
    else if constexpr (sizeof(X) == 4)
      load_sum(w, x, parts, (size_t)rows * H, residual, base + 8 * v);
    else
      load_sum(w, x, residual, base + 8 * v);
    if (residual) *reinterpret_cast<uint4*>(residual_out + base + 8 * v) = make_uint4(w[0], w[1], w[2], w[3]);
    sum_sq = norm_unpack(s[i], w, sum_sq);
  }
  norm_store(out + base, s, wv, sum_sq, H, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
rmsnorm_bf16(u16* out, u16* residual_out, const u16* x, const u16* residual, const u16* weight,
             int H, float eps) {
  add_norm_row(blockIdx.x, gridDim.x, out, residual_out, x, residual, weight, H, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
add_rmsnorm_f32(u16* out, u16* residual_out, const float* x, const u16* residual, const u16* weight,
                int H, float eps, int parts) {
  add_norm_row(blockIdx.x, gridDim.x, out, residual_out, x, residual, weight, H, eps, parts);
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
add_rmsnorm_fixed(u16* out, u16* residual_out, long long* x, const u16* residual, const u16* weight, int H,
                  float eps) {
  add_norm_row(blockIdx.x, gridDim.x, out, residual_out, x, residual, weight, H, eps);
}
