// The MoE block of a fused decode step in one launch (T <= 8 rows, NVFP4 or BF16 experts):
//   y = residual + MoE(rms_norm(x)), the bits of router_topk_cluster_norm, moe_gate_up and moe_down.
//
// Three launches take ~18 µs a layer at batch 1 against ~3.5 µs for their bytes: the experts'
// weights cannot be asked for before the ids are read back from global memory, and down waits on
// gate/up through a kernel boundary (benchmarks/RESULTS.md, session 32). Here:
//
//   1. Every cluster of 8 CTAs routes for itself (router.cu's phases; each CTA holds E/8 gate rows,
//      copied before the wait, and receives every CTA's scores), so no CTA waits on another for
//      the ids. Before the wait a CTA also copies the shared expert's tile of its own (below).
//   2. Each CTA copies the chosen experts' weights it needs into slots of shared memory (bulk
//      copies, the copy engine): its gate/up tiles and its down tile's rows of every chosen expert,
//      the whole MoE in flight at once at batch 1 (rings at larger batches).
//   3. Gate/up from shared memory: the CTA's two 4-warp quads each compute a tile exactly as a
//      moe_gate_up CTA does (same k-steps per warp, same order), store h; a grid-wide counter.
//   4. Down from shared memory: a CTA owns 16 outputs, each warp runs two of moe_down's 16 warps
//      (same items, same order); the partial sums meet as in moe_down, + the residual.
// moe_fused_direct_{nvfp4,bf16} skip the slots (2-4): they read the weights from global memory as
// moe_gate_up and moe_down do, each CTA asking L2 for all its tiles once routed (MF_PREFETCH). A
// BF16 gate/up tile is 64 KB: BF16 takes this path only.
//
// Work: gate/up item j (the grid's items: the shared expert's I/8 tiles, then each routed expert's
// in first-occurrence order) goes to CTA j % C; down tile n (outputs 16n .. 16n + 15) to CTA n % C.
// Every CTA of the grid must be resident at once (the counter): the host sizes the grid from
// cuOccupancyMaxActiveClusters. The dependents are released first thing: griddepcontrol.
// launch_dependents takes effect only once every CTA of the grid has issued it, so a dependent's
// waiting CTA never holds an SM one of ours still needs. The last CTA through zeroes the counters
// for the next launch (graph replays).
//
// Shared memory (dynamic; kernels/moe.py fused_moe_bytes mirrors it), slots of 16 weight rows
// (smem_tiles.cuh):
//   R  the router's gate rows; once routed, the rings: MF_GU_SLOTS gate/up slots, MF_DOWN_SLOTS down slots
//   x [T][2H + 16] | scores [T][E] | bias [E]       (router.cu RouterSmem)
//   P  the shared expert's gate/up slot (later moe_down's partial sums), its down slot
#include "router.cu"
#include "moe.cu"
#include "smem_tiles.cuh"

#define MF_WARPS RC_WARPS
#define MF_THREADS (MF_WARPS * 32)
#define MF_QUAD 4         // moe_gate_up's warps for NVFP4 (kernels/moe.py gate_up_warps)
#define MF_UNROLL NVFP4_UNROLL
#define MF_DOWN_VW 16     // moe_down's warps: each warp here runs two
#define MF_GU_SLOTS 4
#define MF_DOWN_SLOTS 8
#define MF_BARS (3 + MF_GU_SLOTS + MF_DOWN_SLOTS)  // router gate, shared gate/up, shared down, rings
#ifndef MF_DOWN_EARLY
#define MF_DOWN_EARLY 1  // a define (kernels/moe.py FUSED_DOWN_EARLY): the down ring copied with gate/up's, or after its first round
#endif
#ifndef MF_PREFETCH
#define MF_PREFETCH 1    // a define (kernels/moe.py FUSED_PREFETCH): the direct kernels ask L2 for their tiles once routed
#endif
#define MF_RED_DOWN_BYTES (MF_DOWN_VW * 4 * 32 * 4)
static_assert(MF_WARPS == 2 * MF_QUAD, "two gate/up quads a CTA");
static_assert(MOE_DOWN_WARPS == MF_DOWN_VW, "moe_down's CTA: 16 warps");

// Gate/up tile `tile` (rows 8 tile .. + 7) of one expert: gate rows then up rows (moe_gate_up's A rows).
__device__ __forceinline__ void load_gate_up(u32 slot, const SlotShape& shape, const Nvfp4Weights& gate,
                                             const Nvfp4Weights& up, int tile, int K, u32 bar) {
  const size_t r0 = (size_t)tile * 8;
  slot_load(slot, shape, K, gate.codes + r0 * (K / 2), gate.scales + r0 * (K / 16), up.codes + r0 * (K / 2),
            up.scales + r0 * (K / 16), bar);
}

// What the routing leaves for the experts, in static shared memory.
struct MfLists {
  u64 bars[MF_BARS + RC_ST_ASYNC];  // RC_ST_ASYNC: the last counts the router's scores (router_scores_bar)
  float red[MF_WARPS * 4 * 32];  // the router's partial sums, then gate/up's
  int route_ids[MOE_MAX_PAIRS];
  float route_weights[MOE_MAX_PAIRS];
  int expert[MOE_MAX_PAIRS + 1];
  int slot_of[MOE_MAX_PAIRS + 1][8];
  float coef[MOE_MAX_PAIRS + 1][8];
  float tensor_scales[3 * ROUTER_MAX_EXPERTS + 3];  // gate, up, down [E] each, the shared expert's three
};

// The kernels' body. SLOTS: the experts' weights through shared-memory slots (NVFP4); else read
// from global memory as moe_gate_up / moe_down read them, with MF_PREFETCH an L2 prefetch of the
// CTA's tiles right after routing. GU_W: moe_gate_up's warps (4: two tiles at once; 8: one);
// U_GU, U_DOWN: its and moe_down's unrolls.
template <class Wt, bool SLOTS, int GU_W, int U_GU, int U_DOWN>
__device__ __forceinline__ void moe_fused_body(u16* y, u16* h, const u16* x, const u16* residual, int* counters,
                                               const u16* router_gate, const float* bias, const u16* norm_weight,
                                               float eps, int A, float scaling, Wt gate, Wt up, Wt down, Wt sgate,
                                               Wt sup, Wt sdown, int has_shared, int* ids_out, float* weights_out,
                                               int T, int E, int H, int I) {
  constexpr int QUADS = MF_WARPS / GU_W;  // gate/up tiles at once
  static_assert(!SLOTS || GU_W == MF_QUAD, "the slots path runs NVFP4's 4-warp gate/up");
  extern __shared__ __align__(16) unsigned char mf_smem[];
  __shared__ MfLists l;
  __shared__ typename Wt::Shared sh;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int C = gridDim.x, c = blockIdx.x;
  const u32 rank = cluster_ctarank();
  const SlotShape gu_shape = slot_shape(H), d_shape = slot_shape(I);
  const int tpe = I / 8, n_out = H / 16;  // gate/up tiles an expert, down tiles
  const RouterSmem s = router_smem(mf_smem, rank, T, E, H,
                                   SLOTS ? MF_GU_SLOTS * gu_shape.bytes + MF_DOWN_SLOTS * d_shape.bytes : 0);
  unsigned char* pre = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<size_t>(s.bias + E) + 15) & ~static_cast<size_t>(15));
  const u32 gu_ring = smem_addr(mf_smem), d_ring = gu_ring + MF_GU_SLOTS * gu_shape.bytes;
  const u32 pre_gu = smem_addr(pre), pre_d = pre_gu + max(gu_shape.bytes, MF_RED_DOWN_BYTES);
  float* red_down = reinterpret_cast<float*>(pre);  // (slots: over the shared gate/up slot, consumed by then)
  auto bar = [&](int i) { return smem_addr(&l.bars[i]); };
  float* ts = l.tensor_scales;
  pdl_launch_dependents();  // first thing (see the top of this file)
  stage_tensor_scales(gate, ts, E);
  stage_tensor_scales(up, ts + E, E);
  stage_tensor_scales(down, ts + 2 * E, E);
  stage_tensor_scales(sgate, ts + 3 * E, has_shared);
  stage_tensor_scales(sup, ts + 3 * E + 1, has_shared);
  stage_tensor_scales(sdown, ts + 3 * E + 2, has_shared);
  Wt::init_shared(sh);
  if (threadIdx.x == 0) {
    for (int i = 0; i < MF_BARS; ++i) mbarrier_init(bar(i), 1);
    router_scores_bar(bar(MF_BARS), true, T, E);
    fence_mbarrier_init();
  }
  __syncthreads();

  // Before the wait: the router's gate rows (warp 0); SLOTS: this CTA's tile of the shared expert
  // (warp 1) and its down rows for the CTA's first down tile (warp 2); the bias.
  router_load_gate(s, router_gate, bar(0), H);
  const bool gu_pre = SLOTS && has_shared && c < tpe, d_pre = SLOTS && has_shared && c < n_out;
  if constexpr (SLOTS) {
    if (warp == 1 && gu_pre) load_gate_up(pre_gu, gu_shape, sgate, sup, c, H, bar(1));
    if (warp == 2 && d_pre) slot_load_rows(pre_d, d_shape, sdown, c * 16, I, bar(2));
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) s.bias[e] = bias[e];
  cluster_arrive_relaxed();  // every CTA has started: waited on before writing into the others
  uint4 wv[NORM_MAX_VEC];
  norm_weight_load(wv, norm_weight, H / 8);

  // 1. route: the normed rows in x's place, every CTA of the cluster given all the scores
  pdl_wait();
  router_stage_x<true, false>(s, x, wv, nullptr, rank, T, H, eps);
  router_scores(s, l.red, bar(0), T, E, H, 0, RC_CTAS - 1, bar(MF_BARS));
  for (int tok = warp; tok < T; tok += MF_WARPS)
    router_select(l.route_ids + tok * A, l.route_weights + tok * A, s.scores + tok * E, s.bias, E, A, scaling);
  __syncthreads();
  if (c == 0 && ids_out)
    for (int i = threadIdx.x; i < T * A; i += blockDim.x) ids_out[i] = l.route_ids[i], weights_out[i] = l.route_weights[i];
  // expert[u]: routed in first-occurrence order, then the shared one (-1); moe_down's list
  const int U = moe_expert_list<Wt, true>(l.expert, l.slot_of, l.coef, l.route_ids, l.route_weights, down, sdown,
                                          has_shared, T, A, E);

  // 2. this CTA's weights: into the rings (SLOTS; R: the router's gate rows are read, see the
  // barriers above), or asked of L2
  const int n_gu = U * tpe, gu_items = c < n_gu ? (n_gu - 1 - c) / C + 1 : 0;
  const int gu_ring_items = gu_items - gu_pre;
  const int d_tiles = c < n_out ? (n_out - 1 - c) / C + 1 : 0, d_ring_items = d_tiles * U - d_pre;
  // gate/up item i of this CTA (grid item c + i C): the shared expert's tile, or a routed expert's
  auto gu_expert = [&](int i, int& tile) {
    const int j = c + i * C;
    tile = j % tpe;
    return has_shared && j < tpe ? -1 : l.expert[(j - has_shared * tpe) / tpe];
  };
  // down chunk (tile m, expert u) -> its ring index; the (0, shared) chunk is the pre slot's
  auto d_ring_index = [&](int m, int u) {
    const int seq = m * U + u;
    return d_pre && seq > U - 1 ? seq - 1 : seq;
  };
  auto gu_issue = [&](int q) {  // SLOTS only
    if constexpr (SLOTS) {
      int tile;
      const int e = gu_expert(q + gu_pre, tile);
      load_gate_up(gu_ring + (q % MF_GU_SLOTS) * gu_shape.bytes, gu_shape, e < 0 ? sgate : gate.expert(e, I, H),
                   e < 0 ? sup : up.expert(e, I, H), tile, H, bar(3 + q % MF_GU_SLOTS));
    }
  };
  auto d_issue = [&](int q) {  // SLOTS only
    if constexpr (SLOTS) {
      const int seq = d_pre && q >= U - 1 ? q + 1 : q, m = seq / U, e = l.expert[seq - m * U];
      slot_load_rows(d_ring + (q % MF_DOWN_SLOTS) * d_shape.bytes, d_shape, e < 0 ? sdown : down.expert(e, H, I),
                     (c + m * C) * 16, I, bar(3 + MF_GU_SLOTS + q % MF_DOWN_SLOTS));
    }
  };
  auto d_issue_ring = [&]() {  // warp 1
    fence_proxy_async_shared();
    for (int q = 0; q < min(MF_DOWN_SLOTS, d_ring_items); ++q) d_issue(q);
  };
  if constexpr (SLOTS) {
    if (warp == 0) {
      fence_proxy_async_shared();
      for (int q = 0; q < min(MF_GU_SLOTS, gu_ring_items); ++q) gu_issue(q);
    } else if (warp == 1 && (MF_DOWN_EARLY || gu_items == 0)) {
      d_issue_ring();
    }
  } else if (MF_PREFETCH) {
    for (int q = threadIdx.x; q < gu_items + d_tiles * U; q += blockDim.x) {
      if (q < gu_items) {
        int tile;
        const int e = gu_expert(q, tile);
        (e < 0 ? sgate : gate.expert(e, I, H)).prefetch(tile * 8, 8, H);
        (e < 0 ? sup : up.expert(e, I, H)).prefetch(tile * 8, 8, H);
      } else {
        const int m = (q - gu_items) / U, e = l.expert[q - gu_items - m * U];
        (e < 0 ? sdown : down.expert(e, H, I)).prefetch((c + m * C) * 16, 16, I);
      }
    }
  }

  // 3. gate/up: group q of GU_W warps takes items QUADS r + q of round r
  const int quad = warp / GU_W, wq = warp % GU_W;
  float* red_q = l.red + quad * GU_W * 4 * 32;
  const u32 x_row = g < T ? smem_addr(s.x + g * s.pitch) : 0u;
  for (int i0 = 0; i0 < gu_items; i0 += QUADS) {
    const int i = i0 + quad;
    if (i < gu_items) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (SLOTS) {
        u32 slot = pre_gu;
        if (i < gu_pre) {
          mbarrier_wait_parity(bar(1), 0);
        } else {
          const int q = i - gu_pre;
          slot = gu_ring + (q % MF_GU_SLOTS) * gu_shape.bytes;
          mbarrier_wait_parity(bar(3 + q % MF_GU_SLOTS), (q / MF_GU_SLOTS) & 1);
        }
        slot_partial<GU_W, U_GU>(acc, slot, gu_shape, x_row, H, wq, sh);
      } else {
        int tile;
        const int e = gu_expert(i, tile), row = tile * 8 + g;
        const Wt wg = e < 0 ? sgate : gate.expert(e, I, H), wu = e < 0 ? sup : up.expert(e, I, H);
        global_partial<Wt, GU_W, U_GU>(acc, Wt::rows(wg, row, wu, row, H), x_row, H, wq, sh);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) red_q[(wq * 4 + k) * 32 + lane] = acc[k];
    }
    __syncthreads();
    if constexpr (SLOTS) {
      if (!MF_DOWN_EARLY && i0 == 0 && warp == 1) d_issue_ring();
      if (warp == 0)  // the slots this round read, refilled
        for (int k = max(i0, (int)gu_pre); k < min(i0 + QUADS, gu_items); ++k)
          if (k - gu_pre + MF_GU_SLOTS < gu_ring_items) gu_issue(k - gu_pre + MF_GU_SLOTS);
    }
    const int tq = threadIdx.x % (GU_W * 32), j = tq >> 3, b = tq & 7;
    if (i < gu_items && j < 8 && b < T) {  // moe_gate_up's epilogue
      int tile;
      const int e = gu_expert(i, tile);
      const int slot = moe_slot_of(l.route_ids, b, A, e);
      if (slot >= 0) {
        const float gv = tile_sum<GU_W>(red_q, j, b) * (e < 0 ? sgate.sum_scale() : gate.sum_scale(e));
        const float uv = tile_sum<GU_W>(red_q, j + 8, b) * (e < 0 ? sup.sum_scale() : up.sum_scale(e));
        h[((size_t)b * (A + 1) + slot) * I + tile * 8 + j] = f32_to_bf16(silu(gv) * uv);
      }
    }
    __syncthreads();
  }

  if (threadIdx.x == 0) grid_barrier(counters, C);
  __syncthreads();

  // 4. down: warp w runs moe_down's warps w and w + 8 over items f = u * steps + k-step
  const int steps = I / Wt::KSTEP, items = U * steps;
  for (int m = 0; m < d_tiles; ++m) {
    const int n0 = (c + m * C) * 16;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    auto h_of = [&](int u, int k) {
      const int sl = l.slot_of[u][g];
      return sl >= 0 ? ld_cg_x_of<Wt>(h + ((size_t)g * (A + 1) + sl) * I + k) : Wt::zero_x();
    };
    if constexpr (SLOTS) {
      for (int p0 = 0; p0 < items; p0 += MF_DOWN_VW) {
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const int f = p0 + warp + MF_WARPS * v;
          if (f < items) {
            const int u = f / steps, k = (f - u * steps) * Wt::KSTEP + t * Wt::LANE_K;
            u32 slot = pre_d;
            if (m == 0 && u == U - 1 && d_pre) {
              mbarrier_wait_parity(bar(2), 0);
            } else {
              const int q = d_ring_index(m, u);
              slot = d_ring + (q % MF_DOWN_SLOTS) * d_shape.bytes;
              mbarrier_wait_parity(bar(3 + MF_GU_SLOTS + q % MF_DOWN_SLOTS), (q / MF_DOWN_SLOTS) & 1);
            }
            moe_down_accumulate<Wt>(acc[v], slot_frag(slot, d_shape, g, k), h_of(u, k), l.coef[u][2 * t],
                                    l.coef[u][2 * t + 1], sh);
          }
        }
        __syncthreads();
        if (warp == 1)  // the experts this pass finished (16 % steps == 0: whole experts), refilled
          for (int u = p0 / steps; u < min(U, (p0 + MF_DOWN_VW) / steps); ++u)
            if (!(m == 0 && u == U - 1 && d_pre)) {
              const int q = d_ring_index(m, u) + MF_DOWN_SLOTS;
              if (q < d_ring_items) d_issue(q);
            }
      }
    } else {
      // rounds of U_DOWN items of one of the warp's two moe_down warps: every load first
#pragma unroll
      for (int v = 0; v < 2; ++v)
        for (int f0 = warp + MF_WARPS * v; f0 < items; f0 += MF_DOWN_VW * U_DOWN) {
          typename Wt::Frag fr[U_DOWN];
          typename Wt::X xv[U_DOWN];
#pragma unroll
          for (int i = 0; i < U_DOWN; ++i) {
            const int f = f0 + i * MF_DOWN_VW, u = min(f / steps, U - 1);
            const int k = (f - u * steps) * Wt::KSTEP + t * Wt::LANE_K, e = l.expert[u];
            const Wt w = e < 0 ? sdown : down.expert(e, H, I);
            fr[i] = f < items ? Wt::load(Wt::rows(w, n0 + g, w, n0 + g + 8, I), k) : Wt::zero();
          }
#pragma unroll
          for (int i = 0; i < U_DOWN; ++i) {
            const int f = f0 + i * MF_DOWN_VW, u = min(f / steps, U - 1);
            xv[i] = f < items ? h_of(u, (f - u * steps) * Wt::KSTEP + t * Wt::LANE_K) : Wt::zero_x();
          }
#pragma unroll
          for (int i = 0; i < U_DOWN; ++i) {
            const int f = f0 + i * MF_DOWN_VW;
            if (f < items)
              moe_down_accumulate<Wt>(acc[v], fr[i], xv[i], l.coef[f / steps][2 * t], l.coef[f / steps][2 * t + 1],
                                      sh);
          }
        }
    }
#pragma unroll
    for (int v = 0; v < 2; ++v)
#pragma unroll
      for (int k = 0; k < 4; ++k) red_down[((warp + MF_WARPS * v) * 4 + k) * 32 + lane] = acc[v][k];
    __syncthreads();
    const int r = threadIdx.x >> 3, b = threadIdx.x & 7;
    if (r < 16 && b < T) {  // moe_down's epilogue
      float v = tile_sum<MF_DOWN_VW>(red_down, r, b);
      if (residual) v += bf16_to_f32(residual[(size_t)b * H + n0 + r]);
      y[(size_t)b * H + n0 + r] = f32_to_bf16(v);
    }
    __syncthreads();
  }
}

#define MF_ARGS(p) const u8 *p##_codes, const u8 *p##_scales, const float *p##_tensor_scale
#define MF_NVFP4(p) Nvfp4Weights{p##_codes, p##_scales, p##_tensor_scale}
#define MF_COMMON_ARGS                                                                                        \
  u16 *y, u16 *h, const u16 *x, const u16 *residual, int *counters, const u16 *router_gate, const float *bias, \
      const u16 *norm_weight, float eps, int A, float scaling
#define MF_COMMON y, h, x, residual, counters, router_gate, bias, norm_weight, eps, A, scaling

// h [T, A + 1, I] as moe_gate_up's; counters: 2 ints, zero; ids / weights: cluster 0's routing
// written there when non-null (tests). x is the rows before the norm (residual may be x).
extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(MF_THREADS, 1)
moe_fused_nvfp4(MF_COMMON_ARGS, MF_ARGS(g), MF_ARGS(u), MF_ARGS(d), MF_ARGS(sg), MF_ARGS(su), MF_ARGS(sd),
                int has_shared, int* ids_out, float* weights_out, int T, int E, int H, int I) {
  moe_fused_body<Nvfp4Weights, true, MF_QUAD, MF_UNROLL, MF_UNROLL>(
      MF_COMMON, MF_NVFP4(g), MF_NVFP4(u), MF_NVFP4(d), MF_NVFP4(sg), MF_NVFP4(su), MF_NVFP4(sd), has_shared, ids_out,
      weights_out, T, E, H, I);
}

// The same reading the experts' weights from global memory (MOE_GATE_UP_WARPS: moe_gate_up's
// warps for the format and rows, kernels/moe.py gate_up_warps).
extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(MF_THREADS, 1)
moe_fused_direct_nvfp4(MF_COMMON_ARGS, MF_ARGS(g), MF_ARGS(u), MF_ARGS(d), MF_ARGS(sg), MF_ARGS(su), MF_ARGS(sd),
                       int has_shared, int* ids_out, float* weights_out, int T, int E, int H, int I) {
  moe_fused_body<Nvfp4Weights, false, MOE_GATE_UP_WARPS, NVFP4_UNROLL, NVFP4_UNROLL>(
      MF_COMMON, MF_NVFP4(g), MF_NVFP4(u), MF_NVFP4(d), MF_NVFP4(sg), MF_NVFP4(su), MF_NVFP4(sd), has_shared, ids_out,
      weights_out, T, E, H, I);
}

extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(MF_THREADS, 1)
moe_fused_direct_bf16(MF_COMMON_ARGS, const u16* gate, const u16* up, const u16* down, const u16* shared_gate,
                      const u16* shared_up, const u16* shared_down, int has_shared, int* ids_out, float* weights_out,
                      int T, int E, int H, int I) {
  moe_fused_body<Bf16Weights, false, MOE_GATE_UP_WARPS, BF16_UNROLL, BF16_UNROLL>(
      MF_COMMON, Bf16Weights{gate}, Bf16Weights{up}, Bf16Weights{down}, Bf16Weights{shared_gate},
      Bf16Weights{shared_up}, Bf16Weights{shared_down}, has_shared, ids_out, weights_out, T, E, H, I);
}
