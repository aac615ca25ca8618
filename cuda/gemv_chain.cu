// A probe for issue 17's persistent decode (benchmarks/bench_persistent.py): what a dependency costs
// when it is a counter in global memory instead of a kernel boundary. A chain of `layers` NVFP4
// GEMVs of one token, h[i + 1] = W[i] . h[i] (W [layers, N, K], N == K), in ONE launch: CTA c owns
// rows 16c .. 16c + 15 of every layer (gridDim.x = N / 16, all resident at once, else it deadlocks:
// the launcher checks). Layer i's CTAs wait until every CTA has finished layer i - 1 (done[i - 1] ==
// gridDim.x), asking L2 for their weight rows before they wait, as gemv.cu's kernels do before
// `pdl_wait`. The math is gemv.cu's for one token (same tile loop, warps and sum order), so the
// result equals `linear` launched layer by layer, bit for bit. `done` [layers] must be zero at launch.
// Defines: GEMV_WARPS (8 or 16), CHAIN_SLEEP_NS (the waiting thread's pause between polls; 0: none),
// TICKET_ACQ_REL (common.cuh: the count a release atomic instead of fence.sc then a relaxed one).
#include "gemv_tile.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 16
#endif
#ifndef CHAIN_SLEEP_NS
#define CHAIN_SLEEP_NS 0
#endif
#define NVFP4_UNROLL 4  // gemv.cu's
#define CHAIN_RED (GEMV_WARPS * 4 * 32)

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_chain_nvfp4(u16* h, const u8* codes, const u8* scales, const float* tensor_scale, int* done, int layers,
                 int N, int K) {
  __shared__ float red[CHAIN_RED];
  __shared__ Nvfp4Weights::Shared sh;
  Nvfp4Weights::init_shared(sh);
  const int g = (threadIdx.x & 31) >> 2, n0 = blockIdx.x * 16;
  const Nvfp4Weights stack{codes, scales, tensor_scale};
  for (int i = 0; i < layers; ++i) {
    const Nvfp4Weights wt = stack.expert(i, N, K);
    if (threadIdx.x == 0) {
      wt.prefetch(n0, 16, K);
      if (i > 0)
        while (ld_acquire_gpu(done + i - 1) < (int)gridDim.x)
          if (CHAIN_SLEEP_NS) __nanosleep(CHAIN_SLEEP_NS);
    }
    __syncthreads();  // layer i - 1 complete for the whole CTA; `red` free again; `sh` filled
    const u16* const xs[1] = {g == 0 ? h + (size_t)i * K : nullptr};  // token 0 feeds lane group 0
    float acc[1][4] = {};
    tile_partial_groups<Nvfp4Weights, GEMV_WARPS, NVFP4_UNROLL, false, 1>(acc, Nvfp4Weights::rows(
        wt, n0 + g, wt, n0 + g + 8, K), xs, K, 0, K / Nvfp4Weights::KSTEP, sh);
    tile_store_partials<GEMV_WARPS>(red, acc[0]);
    __syncthreads();
    const int r = threadIdx.x >> 3;
    if (r < 16 && (threadIdx.x & 7) == 0)
      h[(size_t)(i + 1) * N + n0 + r] = f32_to_bf16(tile_sum<GEMV_WARPS>(red, r, 0) * wt.sum_scale());
    __syncthreads();
    if (threadIdx.x == 0)  // the CTA's h stores (ordered before by the barrier), then the count
      ticket_arrive(reinterpret_cast<u32*>(done + i));
  }
}
