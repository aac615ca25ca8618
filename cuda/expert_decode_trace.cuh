// The decode MoE's trace build (ED_TRACE 1; benchmarks/decode_moe_trace.py): expert_decode_moe_nvfp4
// takes a last argument u64 trace[grid][ED_TRACE_SLOTS] and each CTA's thread 0 writes its
// %globaltimer at its phases (slots 0-5: entry, unit taken, inputs ready, x staged, warp 0's rounds
// done, end), its SM (6) and its unit (7); 0 where a CTA did not get there. Without ED_TRACE every
// call here is empty and the kernels compile as if it were not included.
#pragma once
#include "common.cuh"

#ifndef ED_TRACE
#define ED_TRACE 0
#endif
#define ED_TRACE_SLOTS 8  // kernels/expert_decode.py TRACE_SLOTS
#define ED_TRACE_SM 6
#define ED_TRACE_UNIT 7

#if ED_TRACE
__shared__ unsigned long long* ed_trace_row;  // this CTA's row of trace; null: not traced
#define ED_TRACE_PARAM , unsigned long long* trace
#define ED_TRACE_ARG trace
#else
#define ED_TRACE_PARAM
#define ED_TRACE_ARG nullptr
#endif

// Writes `value` (default: the time) into this CTA's slot.
__device__ __forceinline__ void ed_record(int slot, unsigned long long value) {
#if ED_TRACE
  if (threadIdx.x == 0 && ed_trace_row) ed_trace_row[slot] = value;
#endif
}
__device__ __forceinline__ void ed_mark(int slot) {
#if ED_TRACE
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  ed_record(slot, t);
#endif
}

// First thing in a kernel: its CTA's row (null: a kernel that is not traced), zeroed, with its SM.
__device__ __forceinline__ void ed_trace_begin(unsigned long long* trace) {
#if ED_TRACE
  if (threadIdx.x == 0) {
    ed_trace_row = trace ? trace + (size_t)blockIdx.x * ED_TRACE_SLOTS : nullptr;
    if (trace)
      for (int i = 0; i < ED_TRACE_SLOTS; ++i) ed_trace_row[i] = 0;
  }
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  ed_record(ED_TRACE_SM, sm);
  ed_mark(0);
#else
  (void)trace;
#endif
}
