// Shared by the decode-attention kernels: KV-cache addressing (ldmatrix and bulk copies: async_copy.cuh).
// Head dim is fixed at 128 (HEAD_DIM) and GQA groups at 8 query heads per KV head (GROUP).
// A KV row is `num_kv_heads * 128` bf16 values; head g of row r starts at r * G * 128 + g * 128.
#pragma once
#include "async_copy.cuh"

#define HEAD_DIM 128
#define GROUP 8

// Row of the layer's pool (K or V, [pages, page_rows, G, 128]) that holds position p of request b:
//
//   paged (block_tables != null):   page = block_tables[b][p / page_rows]   (page_rows = block_size)
//        positions 0 1 2 3 | 4 5 6 7 | 8 9 ..      block_table[b] = [7, 2, 9, ..]
//        rows      7*4+0.. | 2*4+0.. | 9*4+0..
//   ring  (block_tables == null):   page = ring_slots[b]     (page_rows = the ring's rows >= window)
//        position p -> row p % page_rows of the slot; the newest page_rows positions are resident
//
//   row = page * page_rows + p % page_rows   (64-bit: pools exceed 2^31 elements)
struct KvPages {
  const int* table;  // this request's block table row, or null for a ring
  long long ring_page;
  int page_rows;

  __device__ __forceinline__ KvPages(const int* block_tables, int table_stride, const int* ring_slots,
                                     int page_rows_, int b)
      : table(block_tables ? block_tables + (long long)b * table_stride : nullptr),
        ring_page(block_tables ? 0 : ring_slots[b]),
        page_rows(page_rows_) {}

  __device__ __forceinline__ long long row(int p) const {
    const long long page = table ? (long long)table[p / page_rows] : ring_page;
    return page * page_rows + p % page_rows;
  }
};

// FP8 KV cache (e4m3, scale 1, kernels/attention.py KV_DTYPES): 4 values per 32-bit word, byte i
// = value i. Writes saturate to +-448 (no NaN from a large value); reads are exact in f16 and bf16.
// Four bf16 values (two bf16x2 words, the cache's bf16 row) as four e4m3.
__device__ __forceinline__ u32 e4m3x4_from_bf16x4(uint2 v) {
  u16 lo, hi;  // cvt puts its first operand in the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(bf16x2_hi(v.x)), "f"(bf16x2_lo(v.x)));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(bf16x2_hi(v.y)), "f"(bf16x2_lo(v.y)));
  return (u32)lo | ((u32)hi << 16);
}
// Two e4m3 values (the low 16 bits of v: byte 0 -> the low half) as f16x2.
__device__ __forceinline__ u32 f16x2_from_e4m3x2(u32 v) {
  u32 d;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(d) : "r"(v));
  return d;
}
// The high two (bytes 2, 3): the same as f16x2_from_e4m3x2(v >> 16) without the shift (the
// conversion reads the upper half of the register).
__device__ __forceinline__ u32 f16x2_from_e4m3x2_hi(u32 v) {
  u32 d;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(v));
  return d;
}
// Two e4m3 values as bf16x2 (exact: every e4m3 value is a bf16 value).
__device__ __forceinline__ u32 bf16x2_from_e4m3x2(u32 v) {
  const u32 h = f16x2_from_e4m3x2(v);
  float lo, hi;
  asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
      : "=f"(lo), "=f"(hi) : "r"(h));
  return pack_bf16x2(lo, hi);
}

// A kernel compiled with -DKV_FP8=1 takes e4m3 pools; kv_t is one value of the pool.
#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8
typedef unsigned char kv_t;
#else
typedef u16 kv_t;
#endif

__device__ __forceinline__ int cdiv_i(int a, int b) { return (a + b - 1) / b; }

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY

// Data written by other CTAs of this kernel (after a fence): 16 bytes from L2, bypassing L1.
__device__ __forceinline__ float4 ld_cg_f32x4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}
