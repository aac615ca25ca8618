// Q/K RMSNorm + RoPE of one head by one warp (lane l holds dims 4l .. 4l+3), shared by the decode
// (qk_norm_rope_kv.cu) and prefill (prefill_qkv.cu) kernels, so that a prompt leaves the same K
// bits in the cache as token-by-token decode does. Rounding follows model/reference.py step by step:
// the norm result is rounded to bf16, RoPE reads that bf16 value, and cos/sin come from fp64 angles
// rounded to fp32.
#pragma once
#include "attention_common.cuh"

__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// A lane's four bf16 values as floats, and back.
__device__ __forceinline__ void load_bf16x4(const u16* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = bf16x2_lo(v.x), x[1] = bf16x2_hi(v.x), x[2] = bf16x2_lo(v.y), x[3] = bf16x2_hi(v.y);
}

__device__ __forceinline__ void store_bf16x4(u16* p, const float (&x)[4]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]));
}

// Four bf16 values (a lane's dims 4l .. 4l+3) into a cache row: as they are, or as e4m3 (KV_FP8).
__device__ __forceinline__ void store_kv4(kv_t* dst, uint2 v) {
#if KV_FP8
  *reinterpret_cast<u32*>(dst) = e4m3x4_from_bf16x4(v);
#else
  *reinterpret_cast<uint2*>(dst) = v;
#endif
}

// cos/sin of position p for the 64 frequencies (threads 0..63 write; the caller syncs): as
// rope_cos_sin, the fp64 angle p * inv_freq (inv_freq computed by torch, bit for bit), cos/sin
// rounded to fp32.
__device__ __forceinline__ void rope_table(float* cos_s, float* sin_s, int p, const double* rope_inv_freq) {
  if (threadIdx.x < HEAD_DIM / 2) {
    double sin_a, cos_a;
    sincos((double)p * rope_inv_freq[threadIdx.x], &sin_a, &cos_a);
    cos_s[threadIdx.x] = (float)cos_a;
    sin_s[threadIdx.x] = (float)sin_a;
  }
}

// y = rope(bf16(rms_norm(x) * w)) of this lane's 4 dims; rope false: no rotation (full layers).
__device__ __forceinline__ void norm_rope_lanes(const float (&x)[4], const float (&w)[4], float eps, bool rope,
                                                const float* cos_s, const float* sin_s, int lane, float (&y)[4]) {
  // NOTE: __fmul_rn/__fadd_rn keep the compiler from fusing into FMAs, which torch's separate
  // elementwise ops never do; fused results would differ in the last fp32 bit.
  float sum_sq = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) sum_sq = __fadd_rn(sum_sq, __fmul_rn(x[e], x[e]));
  const float inv_rms = rsqrtf(__fadd_rn(warp_sum(sum_sq) * (1.0f / HEAD_DIM), eps));
#pragma unroll
  for (int e = 0; e < 4; ++e) y[e] = round_bf16(__fmul_rn(__fmul_rn(x[e], inv_rms), w[e]));
  if (rope) {
    // Lanes 0-15 hold x1 = dims 0..63, lanes 16-31 hold x2 = dims 64..127: partner is lane ^ 16.
    //   out1 = x1 cos - x2 sin        out2 = x2 cos + x1 sin
    const bool first_half = lane < 16;
    float r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, y[e], 16);
      const int i = 4 * (lane & 15) + e;
      const float a = __fmul_rn(y[e], cos_s[i]);
      r[e] = first_half ? __fsub_rn(a, __fmul_rn(other, sin_s[i])) : __fadd_rn(a, __fmul_rn(other, sin_s[i]));
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) y[e] = r[e];
  }
}
