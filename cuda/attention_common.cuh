// Shared by the decode-attention kernels: KV-cache addressing, ldmatrix, bulk copies on mbarriers.
// Head dim is fixed at 128 (HEAD_DIM) and GQA groups at 8 query heads per KV head (GROUP).
// A KV row is `num_kv_heads * 128` bf16 values; head g of row r starts at r * G * 128 + g * 128.
#pragma once
#include "common.cuh"

#define HEAD_DIM 128
#define GROUP 8

// Row of the layer's pool (K or V, [pages, page_rows, G, 128]) that holds position p of request b:
//
//   paged (block_tables != null):   page = block_tables[b][p / page_rows]   (page_rows = block_size)
//        positions 0 1 2 3 | 4 5 6 7 | 8 9 ..      block_table[b] = [7, 2, 9, ..]
//        rows      7*4+0.. | 2*4+0.. | 9*4+0..
//   ring  (block_tables == null):   page = ring_slots[b]                    (page_rows = window)
//        position p -> row p % window of the slot; the newest `window` positions are resident
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

__device__ __forceinline__ int cdiv_i(int a, int b) { return (a + b - 1) / b; }

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY

// ---- shared memory, ldmatrix --------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i comes
// back in the mma fragment layout (lane l: row l/4, elements 2(l%4), 2(l%4)+1; transposed for
// .trans). Volatile so it never moves above the mbarrier wait that makes the data visible.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// Data written by other CTAs of this kernel (after a fence): 16 bytes from L2, bypassing L1.
__device__ __forceinline__ float4 ld_cg_f32x4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}

// ---- bulk copies on an mbarrier (sm_90) -------------------------------------------------------
// One thread moves a whole contiguous row (global -> shared) through the copy engine; the stage's
// mbarrier completes when the expected bytes have landed. No tensor map needed.

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes barrier initialization visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier generic shared-memory accesses before later bulk copies into it.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_wait_parity(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
