// NVFP4 weights -> bf16 mma fragments, in registers (Hopper has no FP4 convert instruction).
//
//   weight[n][k] = E2M1(code[n][k]) * UE4M3(scale[n][k/16]) * tensor_scale
//
// A 32-bit code word q holds 8 consecutive weights w0 .. w7 in the bit layout of quant/nvfp4.py
// WORD_BITS. Decoding pairs w_j with w_{j+4}: pair j -> bf16x2 { lo = w_j, hi = w_{j+4} }, each with
// its magnitude bits (e1 e0 m) at bf16 bits 8..6 (the exponent's two low bits and the top mantissa
// bit) and its sign at bit 15, so the bf16 reads E2M1 * 2^-126 for every code, including 0.5 (a
// bf16 subnormal). The word holds pair 0 in those bits already, pairs 1 and 2 rotated left by 3
// and 6, and pair 3 in the bits left over, where a multiply by 2^2 + 2^7 + 2^12 puts each in place
// (no two copies meet, so no carry): 8 integer operations a word. The block scale is pre-multiplied
// by 2^119, so one exact bf16x2 multiply gives block_value * 2^-7; the kernels multiply their fp32
// sums by NVFP4_SUM_SCALE (2^7) * tensor_scale at the end. x pairs are permuted the same way
// (x_j, x_{j+4}), so the dot product is unchanged.
#pragma once
#include "common.cuh"

#define NVFP4_SUM_SCALE 128.0f

// bf16 of UE4M3(byte) * 2^119 in both halves (exact: at most 4 significant bits).
// Byte = x e3 e2 e1 e0 m2 m1 m0, bit 7 ignored except that exactly 0x7F decodes to 0 (ggml's
// rule, `ue4m3_values` in quant/nvfp4.py: 0xFF is 480).
__device__ __forceinline__ u32 ue4m3_scale_bf16x2(u32 byte) {
  const u32 v = byte & 0x7Fu;
  // (1 + m/8) * 2^(E - 7 + 119): the exponent field E + 239 stays <= 254.
  const float normal = __uint_as_float((v << 20) + (239u << 23));
  // E == 0 (subnormal): m * 2^-9 * 2^119 = 2 * normal - 2^113, exactly.
  const float subnormal = fmaf(2.0f, normal, -0x1p113f);
  float s = (v < 8u) ? subnormal : normal;
  s = (byte == 0x7Fu) ? 0.0f : s;
  return pack_bf16x2(s, s);
}

// 8 codes -> 4 bf16x2 pairs (w_j, w_{j+4}) * scale.
__device__ __forceinline__ void e2m1x8_to_bf16(u32 q, u32 scale, u32 (&p)[4]) {
  constexpr u32 PAIR = 0x81C081C0u;  // bits 15 and 8..6 of both halves
  p[0] = mul_bf16x2(q & PAIR, scale);
  p[1] = mul_bf16x2(__funnelshift_r(q, q, 3) & PAIR, scale);
  p[2] = mul_bf16x2(__funnelshift_r(q, q, 6) & PAIR, scale);
  p[3] = mul_bf16x2(((q & 0x001B001Bu) * 0x1084u) & PAIR, scale);
}

// 8 consecutive bf16 x values {x01, x23, x45, x67} -> pairs (x_j, x_{j+4}) matching the decode.
__device__ __forceinline__ void x_pairs_for_e2m1(uint4 x, u32 (&p)[4]) {
  p[0] = prmt(x.x, x.z, 0x5410u);  // x0 x4
  p[1] = prmt(x.x, x.z, 0x7632u);  // x1 x5
  p[2] = prmt(x.y, x.w, 0x5410u);  // x2 x6
  p[3] = prmt(x.y, x.w, 0x7632u);  // x3 x7
}
