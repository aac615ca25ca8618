// Hopper warpgroup MMA (wgmma, sm_90a): D[64 x N] += A[64 x 16] . B[N x 16]^T over bf16 tiles in
// shared memory, fp32 accumulators in the registers of the 128 threads of a warpgroup.
//
// Operands are K-major tiles of 64 bf16 per row (128-byte rows), 16-byte chunks XOR-swizzled by
// (row & 7) -- the 128-byte swizzle, so a tile's base must be 1024-byte aligned:
//
//   row r, chunk c (k = 8c .. 8c+7) lives at  r * 128 + ((c ^ (r & 7)) << 4)
//
// A descriptor names the first row and k-offset of an operand slice: start address >> 4 (k16 step
// kk adds 32 bytes), stride between 8-row groups 1024 bytes, swizzle mode 1 (128 B).
//
// Accumulators: thread t of the warpgroup (warp w = t / 32, lane 4g + q) holds, for each n8 block
// j < N / 8, d[4j] / d[4j + 1] = D[16w + g][8j + 2q .. + 1] and d[4j + 2] / d[4j + 3] = row + 8:
// mma.sync's m16n8 C fragment, once per n8 block.
//
// Order: wgmma_fence() before a k-tile's first wgmma (the accumulators were last written by
// something else, or it is the first); wgmma_commit() after the k-tile's wgmmas; wgmma_wait<N>()
// until at most N committed groups are in flight (0 before reading the accumulators). Shared memory
// written by ordinary stores or cp.async must be fenced (fence_proxy_async_shared) by the writing
// thread before the barrier that publishes it to wgmma (the async proxy).
#pragma once
#include "common.cuh"

// Byte offset of chunk `chunk` (16 bytes) of row `row` in a 128-byte-swizzled tile (above).
__device__ __forceinline__ u32 sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ u64 wgmma_desc(u32 smem_addr) {
  return (u64)((smem_addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// MN-major operand (a B stored [k][n], n contiguous; transposed in the instruction), 128-byte
// swizzle: atoms of 64 n (128 B) x 8 k rows; `n_atom_bytes` apart along n (leading byte offset),
// 8-row groups 1024 bytes apart along k (stride byte offset). A k16 step adds 16 rows (2048 B).
__device__ __forceinline__ u64 wgmma_desc_mn(u32 smem_addr, u32 n_atom_bytes) {
  return (u64)((smem_addr & 0x3FFFFu) >> 4) | ((u64)((n_atom_bytes >> 4) & 0x3FFFu) << 16) |
         ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins the accumulators at this point of the program: the compiler sees wgmma's register writes at
// the issue, so without this it could move their reads (the epilogue) above wgmma_wait, or their
// zeroing below the first wgmma.
template <int R>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments in registers: computed before this point (so before the wgmma_fence).
template <int R>
__device__ __forceinline__ void wgmma_fence_frag(u32 (&a)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// The accumulators' places %0 .. %63 in an instruction's text.
#define WGMMA_D64                                                                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                               \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                     \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                     \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
// The "+f" operand list of 64 accumulators d[i] .. d[i + 63] (inline asm takes no arrays).
#define WGMMA_ACC8(d, i)                                                                                  \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define WGMMA_ACC64(d, i)                                                                                 \
  WGMMA_ACC8(d, i), WGMMA_ACC8(d, (i) + 8), WGMMA_ACC8(d, (i) + 16), WGMMA_ACC8(d, (i) + 24),             \
      WGMMA_ACC8(d, (i) + 32), WGMMA_ACC8(d, (i) + 40), WGMMA_ACC8(d, (i) + 48), WGMMA_ACC8(d, (i) + 56)

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 desc_a, u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      WGMMA_D64 ", "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : WGMMA_ACC64(d, 0), WGMMA_ACC64(d, 64)
      : "l"(desc_a), "l"(desc_b)
      : "memory");
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 desc_a, u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      WGMMA_D64
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : WGMMA_ACC64(d, 0)
      : "l"(desc_a), "l"(desc_b)
      : "memory");
}

// Narrow tiles for swap-AB GEMMs (weights as A, a few token rows as B): m64nNk16, N/2 accumulators.
#define WGMMA_D8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WGMMA_D16 WGMMA_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_D32                                                                                        \
  WGMMA_D16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_SS(n, regs, a, b)                                                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #n "k16.f32.bf16.bf16 {" \
  regs "}, " a ", " b ", p, 1, 1, 0, 0;\n}\n"

// D[64 x N] += A . B^T, both K-major from shared memory; N in {16, 32, 64, 128, 256}.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b) {
  if constexpr (N == 16) {
    asm volatile(WGMMA_SS(16, WGMMA_D8, "%8", "%9") : WGMMA_ACC8(d, 0) : "l"(desc_a), "l"(desc_b) : "memory");
  } else if constexpr (N == 32) {
    asm volatile(WGMMA_SS(32, WGMMA_D16, "%16", "%17")
                 : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8)
                 : "l"(desc_a), "l"(desc_b)
                 : "memory");
  } else if constexpr (N == 64) {
    asm volatile(WGMMA_SS(64, WGMMA_D32, "%32", "%33")
                 : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24)
                 : "l"(desc_a), "l"(desc_b)
                 : "memory");
  } else if constexpr (N == 128) {
    wgmma_m64n128k16(d, desc_a, desc_b);
  } else {
    static_assert(N == 256, "wgmma_ss: N in {16, 32, 64, 128, 256}");
    wgmma_m64n256k16(d, desc_a, desc_b);
  }
}

// Warp-specialized kernels: a warpgroup gives registers back (producers) or takes them (consumers);
// every warp of the warpgroup executes it. The kernel's launch bound fixes the starting count.
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R)); }
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R)); }

// A from registers (the m16 x k16 fragment of mma.sync per warp), B MN-major (transposed).
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      WGMMA_D64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : WGMMA_ACC64(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)
      : "memory");
}

