// Gate/up and down in one launch, NVFP4 (kernels/moe.py moe_split): no grid-wide hop between them.
// A cluster of MS_CTAS CTAs takes one expert's chunk of MS_CHUNK intermediate rows (grid (I / 16,
// pairs) as moe_gate_up's, 16 rows a CTA; a duplicate pair's cluster exits as one). Each CTA stages
// its 16 gate and 16 up rows as moe_gate_up_staged does (two 16-row tiles: gate rows 0-7 with up
// rows 0-7, then rows 8-15, each on 4 of its 8 warps as that kernel's CTA), loads its share of the
// down weight's chunk columns into registers while they land, and computes silu(g) * u of every
// token, rounded to bf16 as h is. It pushes
// that into every CTA of the cluster (st.async), so each holds the chunk's h; then each multiplies
// it by its N / MS_CTAS down rows (one k-step of 128) and adds coefficient x product into acc
// [T, N] (fixed point: common.cuh red_add_fixed, so the sum's bits do not depend on the atomics'
// order) for the tokens that chose the expert. acc holds zeros (or what to add to) before; the next
// launch adds the residual and zeroes it (rmsnorm.cu add_rmsnorm_fixed).
// I % MS_CHUNK == 0, K % 128 == 0, N % (16 * MS_CTAS) == 0, N <= 16 * MS_CTAS * MS_DOWN_TILES * MS_WARPS.
// Dynamic shared memory: 18K (the tiles) + 2 * 8 * MS_CHUNK (h).
#include "moe_experts.cuh"

#define MS_CTAS 8
#define MS_ROWS 16
#define MS_CHUNK (MS_CTAS * MS_ROWS)  // one NVFP4 k-step of down
#define MS_WARPS 8                    // 4 a gate/up tile
#define MS_DOWN_TILES 2               // 16-row down tiles a warp at most

extern "C" __global__ void __cluster_dims__(MS_CTAS, 1, 1) __launch_bounds__(MS_WARPS * 32, 2)
moe_split_nvfp4(long long* acc, const u16* x, const int* ids, const float* routing_weights,
                const u8* g_codes, const u8* g_scales, const float* g_tensor_scale,
                const u8* u_codes, const u8* u_scales, const float* u_tensor_scale,
                const u8* d_codes, const u8* d_scales, const float* d_tensor_scale,
                const u8* sg_codes, const u8* sg_scales, const float* sg_tensor_scale,
                const u8* su_codes, const u8* su_scales, const float* su_tensor_scale,
                const u8* sd_codes, const u8* sd_scales, const float* sd_tensor_scale,
                int T, int A, int I, int K, int N, int E) {
  constexpr int W = MS_WARPS, TW = MS_WARPS / 2;  // warps, warps of a gate/up tile
  extern __shared__ __align__(128) u8 split_smem[];
  __shared__ float red[2][TW * 4 * 32];
  __shared__ Nvfp4Weights::Shared sh;
  __shared__ int pair_expert[MOE_MAX_PAIRS];
  __shared__ float coef[8];
  __shared__ __align__(16) u16 h_mine[8][MS_ROWS];
  __shared__ __align__(8) u64 bars[2];  // the tiles landed; the chunk's h landed
  const u32 tiles = smem_addr(split_smem), h_chunk = tiles + 18 * K;
  const u32 bar_w = smem_addr(&bars[0]), bar_h = smem_addr(&bars[1]);
  Nvfp4Weights::init_shared(sh);
  if (threadIdx.x == 0) {
    mbarrier_init(bar_w, 1);
    mbarrier_init(bar_h, 1);
    mbarrier_arrive_expect_tx(bar_h, 2u * 8 * MS_CHUNK);
    fence_mbarrier_init();
  }
  __syncthreads();
  cluster_arrive_relaxed();  // every CTA has started (its bar_h set): waited on before pushing h
  pdl_wait();
  pdl_launch_dependents();  // after the wait, as moe_gate_up
  int e;
  if (!moe_pair_expert(pair_expert, ids, blockIdx.y, T * A, E, e)) return;  // the same in the whole cluster
  const u32 rank = cluster_ctarank();
  const int chunk = blockIdx.x / MS_CTAS, j0 = blockIdx.x * MS_ROWS;
  const Nvfp4Weights wg = e < 0 ? Nvfp4Weights{sg_codes, sg_scales, sg_tensor_scale}
                                : Nvfp4Weights{g_codes, g_scales, g_tensor_scale}.expert(e, I, K);
  const Nvfp4Weights wu = e < 0 ? Nvfp4Weights{su_codes, su_scales, su_tensor_scale}
                                : Nvfp4Weights{u_codes, u_scales, u_tensor_scale}.expert(e, I, K);
  const Nvfp4Weights wd = e < 0 ? Nvfp4Weights{sd_codes, sd_scales, sd_tensor_scale}
                                : Nvfp4Weights{d_codes, d_scales, d_tensor_scale}.expert(e, N, I);
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar_w, 18u * K);
    moe_stage_tile(tiles, wg, wu, j0, K, bar_w);
    moe_stage_tile(tiles + 9 * K, wg, wu, j0 + 8, K, bar_w);
  }
  if (threadIdx.x < 8) {  // token b's coefficient: routing weight x sum scale, 0 where b did not choose e
    const int b = threadIdx.x, slot = b < T ? moe_slot_of(pair_expert, b, A, e) : -1;
    coef[b] = slot < 0 ? 0.0f : (e < 0 ? 1.0f : __ldcg(routing_weights + b * A + slot)) * wd.sum_scale();
  }

  // This warp's down tiles d = warp + i * W: rows n_cta + 16 d + {g, g + 8}, the chunk's k-step.
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int n_local = N / MS_CTAS, n_cta = rank * n_local, down_tiles = n_local / 16;
  const int kd = chunk * MS_CHUNK + t * Nvfp4Weights::LANE_K;
  Nvfp4Weights::Frag fd[MS_DOWN_TILES];
#pragma unroll
  for (int i = 0; i < MS_DOWN_TILES; ++i) {
    const int n = n_cta + (warp + i * W) * 16 + g;
    fd[i] = warp + i * W < down_tiles ? Nvfp4Weights::load(Nvfp4Weights::rows(wd, n, wd, n + 8, I), kd)
                                      : Nvfp4Weights::zero();
  }

  // Gate/up: tile warp / TW on TW warps, as moe_gate_up_staged's CTA.
  const u16* xg = g < T ? x + (size_t)g * K : nullptr;
  const int tile = warp / TW, tw = warp % TW;
  float gu[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  moe_staged_tile_partial<TW>(gu, Nvfp4Staged::rows(tiles + tile * 9 * K, g, K), xg, tw, t, K, bar_w, sh);
#pragma unroll
  for (int i = 0; i < 4; ++i) red[tile][(tw * 4 + i) * 32 + (threadIdx.x & 31)] = gu[0][i];
  __syncthreads();
  if (threadIdx.x < 8 * MS_ROWS) {  // (row j, token b): silu(g) * u as bf16, zero past T
    const int j = threadIdx.x >> 3, b = threadIdx.x & 7;
    float v = 0.0f;
    if (b < T) {
      const float gv = tile_sum<TW>(red[j >> 3], j & 7, b) * wg.sum_scale();
      const float uv = tile_sum<TW>(red[j >> 3], (j & 7) + 8, b) * wu.sum_scale();
      v = silu(gv) * uv;
    }
    h_mine[b][j] = f32_to_bf16(v);
  }
  __syncthreads();

  // Each CTA's 8 x 16 values into every CTA's h_chunk [8][MS_CHUNK]: 16 bytes a thread.
  cluster_wait_acquire();
  if (threadIdx.x < 16 * MS_CTAS) {
    const u32 q = threadIdx.x >> 4, b = (threadIdx.x >> 1) & 7, half = threadIdx.x & 1;
    const uint4 v = *reinterpret_cast<const uint4*>(&h_mine[b][8 * half]);
    const u32 at = h_chunk + 2 * (b * MS_CHUNK + rank * MS_ROWS + 8 * half);
    st_async_v4(cluster_map(at, q), v, cluster_map(bar_h, q));
  }
  mbarrier_wait_parity_cluster(bar_h, 0);

  // Down: token g's chunk of h is the mma's x; this lane's products (rows g, g + 8; tokens 2t, 2t + 1)
  // of the tokens that chose the expert into acc.
  Nvfp4Weights::X xd[1];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    xd[0].v[i] = g < T ? lds_v4(h_chunk + 2 * (g * MS_CHUNK + t * Nvfp4Weights::LANE_K + 8 * i))
                       : make_uint4(0, 0, 0, 0);
  const float c_even = coef[2 * t], c_odd = coef[2 * t + 1];
#pragma unroll
  for (int i = 0; i < MS_DOWN_TILES; ++i) {
    const int d = warp + i * W;
    if (d < down_tiles) {
      float part[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
      Nvfp4Weights::mma_groups<1>(part, fd[i], xd, sh);
      long long* row = acc + n_cta + d * 16 + g;
      if (c_even != 0.0f) {  // zero for tokens past T
        red_add_fixed(row + (size_t)(2 * t) * N, c_even * part[0][0]);
        red_add_fixed(row + (size_t)(2 * t) * N + 8, c_even * part[0][2]);
      }
      if (c_odd != 0.0f) {
        red_add_fixed(row + (size_t)(2 * t + 1) * N, c_odd * part[0][1]);
        red_add_fixed(row + (size_t)(2 * t + 1) * N + 8, c_odd * part[0][3]);
      }
    }
  }
}
