// Shared device helpers: bf16 <-> fp32, 16-byte loads, mma.sync, warp reductions, PDL.
// Compiled by NVRTC with no system headers: bf16 values travel as raw 16-bit patterns
// (unsigned short) or packed pairs (u32, low half = lower index).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- bf16 <-> fp32 ---------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ float bf16x2_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// Round-to-nearest-even pack: low half <- lo, high half <- hi.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Exact when the products are representable (NVFP4 decode); subnormal inputs are kept (no .ftz).
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint4 mul_bf16x2_v4(uint4 a, uint4 b) {
  return make_uint4(mul_bf16x2(a.x, b.x), mul_bf16x2(a.y, b.y), mul_bf16x2(a.z, b.z), mul_bf16x2(a.w, b.w));
}

// Byte permute: result byte i = byte sel_i of the 8-byte value {b:a}.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// ---- global loads ----------------------------------------------------------------------------
// Weights never change while a kernel runs, so they may be loaded before `pdl_wait`. Their loads
// are volatile asm so that they stay where the source puts them: batched ahead of their uses (the
// compiler otherwise sinks each next to its mma, one round trip per k-step) and, where the source
// says so, above `pdl_wait`. Everything a previous kernel wrote must be read with loads that stay
// below the wait (`ld_act_v4`, ordinary C++ loads, `__ldcg`).

// Read-once weights: non-coherent path, no L1 allocation.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// Weight side data reused by neighbouring lanes and warps (block scales): cached in L1.
__device__ __forceinline__ u32 ld_weight_u16(const void* p) {
  u16 v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// Activations (x rows, h rows, logits): written by the previous kernel, read by every CTA, cached
// in L1. A coherent load in volatile asm with a memory clobber, so that neither compiler moves it
// above `pdl_wait` (an `__ldg`, ld.global.nc, was hoisted above griddepcontrol.wait: a race).
__device__ __forceinline__ uint4 ld_act_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// 16 bytes of shared memory by its 32-bit address (volatile: kept in source order; the store also
// orders as memory for the compiler).
__device__ __forceinline__ uint4 lds_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ u32 lds_u16(u32 addr) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_v4(u32 addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Fixed-point sums (value x 2^32 in an int64): integer atomics add in any order to the same bits,
// where fp32 atomics would round differently from run to run. |value| < 2^31, steps of 2^-32.
__device__ __forceinline__ void red_add_fixed(long long* p, float v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)__float2ll_rn(v * 0x1p32f));
}
__device__ __forceinline__ float fixed_to_f32(long long v) { return __ll2float_rn(v) * 0x1p-32f; }

// Data written by other CTAs of this kernel (after a fence): read from L2, bypassing L1. The
// intrinsics are ordinary memory reads to the compiler (kept below fences, free to overlap).
__device__ __forceinline__ float ld_cg_f32(const float* p) { return __ldcg(p); }
__device__ __forceinline__ u64 ld_cg_u64(const u64* p) { return __ldcg(p); }

// Hint: bring [p, p + bytes) into L2, one request to the bulk copy engine, no registers. Used
// before `pdl_wait` on weights, so their DRAM reads overlap the previous kernel. `bytes` is
// rounded down to a multiple of 16; p must be 16-byte aligned.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
  bytes &= ~15u;
  if (bytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// ---- tensor cores ----------------------------------------------------------------------------

// D[16x8] += A[16x16] * B[16x8], bf16 inputs, fp32 accumulators. Lane l = 4*g + t holds
//   a0 = A[g][2t..2t+1]  a1 = A[g+8][2t..2t+1]  a2 = A[g][2t+8..2t+9]  a3 = A[g+8][2t+8..2t+9]
//   b0 = B[2t..2t+1][g]  b1 = B[2t+8..2t+9][g]
//   d0,d1 = D[g][2t], D[g][2t+1]   d2,d3 = D[g+8][2t], D[g+8][2t+1]
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                 u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same shape with f16 inputs (the FP8 KV cache's decode attention: e4m3 converts to f16 in one
// instruction per pair).
__device__ __forceinline__ void mma_f16_16x8x16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// f16x2 of two floats, lo in the low half.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// ---- reductions ------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v;
}

// This thread's exclusive prefix sum of `mine` over the CTA (threads in order) and, in `total`, the
// CTA's sum. warp_total: shared memory of blockDim / 32 values. Two __syncthreads, the second after
// every read of warp_total (the caller may reuse it, or overwrite what `mine` was summed from).
template <class T>
__device__ __forceinline__ T block_exclusive_sum(T mine, T* warp_total, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T up = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  T before = incl - mine;
  total = 0;
  for (int w = 0; w < nwarps; ++w) {
    if (w < warp) before += warp_total[w];
    total += warp_total[w];
  }
  __syncthreads();
  return before;
}

// ---- programmatic dependent launch (sm_90) ---------------------------------------------------
// NOTE: both are no-ops when the kernel was not launched with programmatic stream
// serialization. `pdl_wait` must precede every read of the previous kernel's outputs and every
// write to memory the previous kernel may still read; the memory clobber keeps the compiler from
// hoisting such accesses above it.
// PERSISTENT_STEP (cuda/decode_step.cu): the kernels' bodies run as tasks of one launch, the
// launch itself waiting once, before its first task. A task waits on the counter of the operation
// before it: in its loop, before the body (then `pdl_wait` is a no-op), or, when the step defers
// it (SI_EARLY_WEIGHTS), where the body calls `pdl_wait` (`step_wait`: its first weights are then
// in flight during the wait, as at a kernel boundary).

#ifndef PERSISTENT_STEP
#define PERSISTENT_STEP 0
#endif

__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

#if PERSISTENT_STEP
__device__ __forceinline__ void step_wait();  // cuda/decode_step.cu
__device__ __forceinline__ void pdl_wait() { step_wait(); }
#else
__device__ __forceinline__ void pdl_wait() { griddep_wait(); }
#endif

// "The last CTA finishes" tickets and grid counters: one thread counts its CTA in, after a barrier
// that follows the CTA's stores the others will read (so they are its stores too, for the ordering).
// TICKET_ACQ_REL (a define: kernels/tickets.py): one atomic with release (those stores before the
// count) and acquire (the others' stores before this thread's later reads, and through the next
// barrier its CTA's), as cutlass's semaphores order theirs; 0: __threadfence() (fence.sc.gpu) before
// a relaxed atomicAdd, and ticket_acquire's second one after it. Returns the count before.
#ifndef TICKET_ACQ_REL
#define TICKET_ACQ_REL 0
#endif
__device__ __forceinline__ u32 ticket_arrive(u32* ticket) {
#if TICKET_ACQ_REL
  u32 before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(ticket) : "memory");
  return before;
#else
  __threadfence();
  return atomicAdd(ticket, 1u);
#endif
}
// After ticket_arrive (or a counter's acquire load): before reading what the other CTAs stored.
__device__ __forceinline__ void ticket_acquire() {
#if !TICKET_ACQ_REL
  __threadfence();
#endif
}

// A counter another CTA bumps after a release (__threadfence() and atomicAdd, or ticket_arrive): this load is ordered before
// the thread's later loads (gpu scope), so what the other CTA wrote before its bump is seen.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if !PERSISTENT_STEP
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
