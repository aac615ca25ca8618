// A probe for issue 17's persistent decode (benchmarks/bench_persistent.py): what a dependency costs
// when it is a counter in global memory instead of a kernel boundary. A chain of `layers` NVFP4
// GEMVs of one token, h[i + 1] = W[i] . h[i] (W [layers, N, K], N == K), in ONE launch: CTA c owns
// rows 16c .. 16c + 15 of every layer (gridDim.x = N / 16, all resident at once, else it deadlocks:
// the launcher checks). Layer i's CTAs wait until every CTA has finished layer i - 1 (done[i - 1] ==
// gridDim.x), asking L2 for their weight rows before they wait, as gemv.cu's kernels do before
// `pdl_wait`. The math is gemv.cu's for one token (same tile loop, warps and sum order), so the
// result equals `linear` launched layer by layer, bit for bit. `done` [layers] must be zero at launch.
// Defines: GEMV_WARPS (8 or 16), CHAIN_SLEEP_NS (the waiting thread's pause between polls; 0: none),
// TICKET_ACQ_REL (common.cuh: the count a release atomic instead of fence.sc then a relaxed one),
// RING_STAGES (gemv_chain_ring_nvfp4's stages).
//
// gemv_chain_ring_nvfp4 is the same chain with its weights streamed ahead (issue 17's producer
// ring): one more warp per CTA whose lane 0 bulk-copies the CTA's 16 rows of layer i + 1, i + 2, ..
// into a ring of RING_STAGES shared-memory stages, waiting only for a stage to be free, never on
// the counters. The GEMV warps wait on the counter and on the stage, then compute from shared
// memory: what a dependency costs once the weights are already on the SM.
#include "gemv_tile.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 16
#endif
#ifndef CHAIN_SLEEP_NS
#define CHAIN_SLEEP_NS 0
#endif
#define NVFP4_UNROLL 4  // gemv.cu's
#ifndef RING_STAGES
#define RING_STAGES 4
#endif
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

// Dynamic shared memory: RING_STAGES x 9K bytes (16 rows of K/2 codes and K/16 scales).
extern "C" __global__ void __launch_bounds__((GEMV_WARPS + 1) * 32)
gemv_chain_ring_nvfp4(u16* h, const u8* codes, const u8* scales, const float* tensor_scale, int* done,
                      int layers, int N, int K) {
  extern __shared__ __align__(128) u8 ring[];
  __shared__ float red[CHAIN_RED];
  __shared__ Nvfp4Weights::Shared sh;
  __shared__ __align__(8) u64 bars[2 * RING_STAGES];  // full[s] (the copies landed), then empty[s]
  const u32 stage_bytes = 9u * K, ring0 = smem_addr(ring);
  const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * RING_STAGES;
  const int n0 = blockIdx.x * 16;
  const Nvfp4Weights stack{codes, scales, tensor_scale};
  Nvfp4Weights::init_shared(sh);
  if (threadIdx.x == 0) {
    for (int s = 0; s < RING_STAGES; ++s) {
      mbarrier_init(full0 + 8 * s, 1);   // the producer's arrive (with the bytes it expects)
      mbarrier_init(empty0 + 8 * s, 1);  // consumer thread 0, once every GEMV warp is done reading
    }
    fence_mbarrier_init();
  }
  __syncthreads();  // the only barrier of all warps: the producer warp leaves when it has issued
  if (threadIdx.x >= GEMV_WARPS * 32) {
    if (threadIdx.x == GEMV_WARPS * 32) {
      for (int i = 0; i < layers; ++i) {
        const int s = i % RING_STAGES;
        if (i >= RING_STAGES) mbarrier_wait_parity(empty0 + 8 * s, (i / RING_STAGES - 1) & 1);
        const Nvfp4Weights wt = stack.expert(i, N, K);
        const u32 dst = ring0 + s * stage_bytes, bar = full0 + 8 * s;
        mbarrier_arrive_expect_tx(bar, stage_bytes);
        Nvfp4Staged::copy_rows(dst, 0, wt, n0, 16, K, bar);
      }
    }
    return;
  }
  const int g = (threadIdx.x & 31) >> 2;
  for (int i = 0; i < layers; ++i) {
    const int s = i % RING_STAGES;
    const Nvfp4Weights wt = stack.expert(i, N, K);
    if (threadIdx.x == 0 && i > 0)
      while (ld_acquire_gpu(done + i - 1) < (int)gridDim.x)
        if (CHAIN_SLEEP_NS) __nanosleep(CHAIN_SLEEP_NS);
    named_bar_sync(1, GEMV_WARPS * 32);  // layer i - 1 complete; `red` free again
    mbarrier_wait_parity(full0 + 8 * s, (i / RING_STAGES) & 1);
    const u16* const xs[1] = {g == 0 ? h + (size_t)i * K : nullptr};
    float acc[1][4] = {};
    tile_partial_groups<Nvfp4Staged, GEMV_WARPS, NVFP4_UNROLL, false, 1>(
        acc, Nvfp4Staged::rows(ring0 + s * stage_bytes, g, K), xs, K, 0, K / Nvfp4Weights::KSTEP, sh);
    tile_store_partials<GEMV_WARPS>(red, acc[0]);
    named_bar_sync(1, GEMV_WARPS * 32);
    if (threadIdx.x == 0) mbarrier_arrive(empty0 + 8 * s);  // every GEMV warp is past stage s
    const int r = threadIdx.x >> 3;
    if (r < 16 && (threadIdx.x & 7) == 0)
      h[(size_t)(i + 1) * N + n0 + r] = f32_to_bf16(tile_sum<GEMV_WARPS>(red, r, 0) * wt.sum_scale());
    named_bar_sync(1, GEMV_WARPS * 32);
    if (threadIdx.x == 0) ticket_arrive(reinterpret_cast<u32*>(done + i));
  }
}
