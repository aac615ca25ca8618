// The MoE block of a fused decode step in one launch (T <= 8 rows, NVFP4 experts):
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
//
// Work: gate/up item j (the grid's items: the shared expert's I/8 tiles, then each routed expert's
// in first-occurrence order) goes to CTA j % C; down tile n (outputs 16n .. 16n + 15) to CTA n % C.
// Every CTA of the grid must be resident at once (the counter): the host sizes the grid from
// cuOccupancyMaxActiveClusters, and the dependents are released only past the counter, so a
// waiting CTA never holds an SM that one of ours still needs. The last CTA through zeroes the
// counters for the next launch (graph replays).
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
#define MF_RED_DOWN_BYTES (MF_DOWN_VW * 4 * 32 * 4)
static_assert(MF_WARPS == 2 * MF_QUAD, "two gate/up quads a CTA");
static_assert(MOE_DOWN_WARPS == MF_DOWN_VW && MOE_GATE_UP_WARPS == MF_QUAD, "moe.cu's CTA shapes");

// Gate/up tile `tile` (rows 8 tile .. + 7) of one expert: gate rows then up rows (moe_gate_up's A rows).
__device__ __forceinline__ void load_gate_up(u32 slot, const SlotShape& shape, const Nvfp4Weights& gate,
                                             const Nvfp4Weights& up, int tile, int K, u32 bar) {
  const size_t r0 = (size_t)tile * 8;
  slot_load(slot, shape, K, gate.codes + r0 * (K / 2), gate.scales + r0 * (K / 16), up.codes + r0 * (K / 2),
            up.scales + r0 * (K / 16), bar);
}

#define MF_ARGS(p) const u8 *p##_codes, const u8 *p##_scales, const float *p##_tensor_scale

// h [T, A + 1, I] as moe_gate_up's; counters: 2 ints, zero; ids / weights: cluster 0's routing
// written there when non-null (tests). x is the rows before the norm (residual may be x).
extern "C" __global__ void __cluster_dims__(RC_CTAS, 1, 1) __launch_bounds__(MF_THREADS, 1)
moe_fused_nvfp4(u16* y, u16* h, const u16* x, const u16* residual, int* counters, const u16* router_gate,
                const float* bias, const u16* norm_weight, float eps, int A, float scaling, MF_ARGS(g), MF_ARGS(u),
                MF_ARGS(d), MF_ARGS(sg), MF_ARGS(su), MF_ARGS(sd), int has_shared, int* ids_out,
                float* weights_out, int T, int E, int H, int I) {
  extern __shared__ __align__(16) unsigned char mf_smem[];
  __shared__ u64 bars[MF_BARS];
  __shared__ float red[MF_WARPS * 4 * 32];  // the router's partial sums, then the quads'
  __shared__ Nvfp4Weights::Shared sh;
  __shared__ int route_ids[MOE_MAX_PAIRS];
  __shared__ float route_weights[MOE_MAX_PAIRS];
  __shared__ int expert[MOE_MAX_PAIRS + 1];
  __shared__ int slot_of[MOE_MAX_PAIRS + 1][8];
  __shared__ float coef[MOE_MAX_PAIRS + 1][8];
  // the tensor scales (gate, up, down: [E] each, then the shared expert's three), read before the
  // wait so that no sum-scale load is an L2 round trip on the way (E <= 256: the cluster router's)
  __shared__ float tensor_scales[3 * ROUTER_MAX_EXPERTS + 3];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int C = gridDim.x, c = blockIdx.x;
  const u32 rank = cluster_ctarank();
  const SlotShape gu_shape = slot_shape(H), d_shape = slot_shape(I);
  const int tpe = I / 8, n_out = H / 16;  // gate/up tiles an expert, down tiles
  const RouterSmem s = router_smem(mf_smem, rank, T, E, H, MF_GU_SLOTS * gu_shape.bytes + MF_DOWN_SLOTS * d_shape.bytes);
  unsigned char* pre = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<size_t>(s.bias + E) + 15) & ~static_cast<size_t>(15));
  const u32 gu_ring = smem_addr(mf_smem), d_ring = gu_ring + MF_GU_SLOTS * gu_shape.bytes;
  const u32 pre_gu = smem_addr(pre), pre_d = pre_gu + max(gu_shape.bytes, MF_RED_DOWN_BYTES);
  float* red_down = reinterpret_cast<float*>(pre);  // over the shared gate/up slot, consumed by then
  auto bar = [&](int i) { return smem_addr(&bars[i]); };
  float* ts = tensor_scales;
  const Nvfp4Weights gate{g_codes, g_scales, ts}, up{u_codes, u_scales, ts + E}, down{d_codes, d_scales, ts + 2 * E};
  const Nvfp4Weights sgate{sg_codes, sg_scales, ts + 3 * E}, sup{su_codes, su_scales, ts + 3 * E + 1};
  const Nvfp4Weights sdown{sd_codes, sd_scales, ts + 3 * E + 2};
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    ts[e] = g_tensor_scale[e];
    ts[E + e] = u_tensor_scale[e];
    ts[2 * E + e] = d_tensor_scale[e];
  }
  if (has_shared && threadIdx.x < 3)
    ts[3 * E + threadIdx.x] = (threadIdx.x == 0 ? sg_tensor_scale : threadIdx.x == 1 ? su_tensor_scale : sd_tensor_scale)[0];

  Nvfp4Weights::init_shared(sh);
  if (threadIdx.x == 0) {
    for (int i = 0; i < MF_BARS; ++i) mbarrier_init(bar(i), 1);
    fence_mbarrier_init();
  }
  __syncthreads();

  // Before the wait: the router's gate rows (warp 0), this CTA's tile of the shared expert (warp 1)
  // and its down rows for the CTA's first down tile (warp 2), the bias.
  router_load_gate(s, router_gate, bar(0), H);
  const bool gu_pre = has_shared && c < tpe, d_pre = has_shared && c < n_out;
  if (warp == 1 && gu_pre) load_gate_up(pre_gu, gu_shape, sgate, sup, c, H, bar(1));
  if (warp == 2 && d_pre) slot_load_rows(pre_d, d_shape, sdown, c * 16, I, bar(2));
  for (int e = threadIdx.x; e < E; e += blockDim.x) s.bias[e] = bias[e];
  cluster_arrive_relaxed();  // every CTA has started: waited on before writing into the others
  uint4 wv[NORM_MAX_VEC];
  norm_weight_load(wv, norm_weight, H / 8);

  // 1. route: the normed rows in x's place, every CTA of the cluster given all the scores
  pdl_wait();
  router_stage_x<true, false>(s, x, wv, nullptr, rank, T, H, eps);
  router_scores(s, red, bar(0), T, E, H, 0, RC_CTAS - 1);
  for (int tok = warp; tok < T; tok += MF_WARPS)
    router_select(route_ids + tok * A, route_weights + tok * A, s.scores + tok * E, s.bias, E, A, scaling);
  __syncthreads();
  if (c == 0 && ids_out)
    for (int i = threadIdx.x; i < T * A; i += blockDim.x) ids_out[i] = route_ids[i], weights_out[i] = route_weights[i];
  // expert[u]: routed in first-occurrence order, then the shared one (-1); moe_down's list
  const int U = moe_expert_list<Nvfp4Weights, true>(expert, slot_of, coef, route_ids, route_weights, down, sdown,
                                                    has_shared, T, A, E);

  // 2. this CTA's weights into the rings (R: the router's gate rows are read, see the barriers above)
  const int n_gu = U * tpe, gu_items = c < n_gu ? (n_gu - 1 - c) / C + 1 : 0;
  const int gu_ring_items = gu_items - gu_pre;
  const int d_tiles = c < n_out ? (n_out - 1 - c) / C + 1 : 0, d_ring_items = d_tiles * U - d_pre;
  // gate/up item i of this CTA (grid item c + i C): the shared expert's tile, or a routed expert's
  auto gu_expert = [&](int i, int& tile) {
    const int j = c + i * C;
    tile = j % tpe;
    return has_shared && j < tpe ? -1 : expert[(j - has_shared * tpe) / tpe];
  };
  // down chunk (tile m, expert u) -> its ring index; the (0, shared) chunk is the pre slot's
  auto d_ring_index = [&](int m, int u) {
    const int seq = m * U + u;
    return d_pre && seq > U - 1 ? seq - 1 : seq;
  };
  auto gu_issue = [&](int q) {
    int tile;
    const int e = gu_expert(q + gu_pre, tile);
    load_gate_up(gu_ring + (q % MF_GU_SLOTS) * gu_shape.bytes, gu_shape, e < 0 ? sgate : gate.expert(e, I, H),
                 e < 0 ? sup : up.expert(e, I, H), tile, H, bar(3 + q % MF_GU_SLOTS));
  };
  auto d_issue = [&](int q) {
    const int seq = d_pre && q >= U - 1 ? q + 1 : q, m = seq / U, e = expert[seq - m * U];
    slot_load_rows(d_ring + (q % MF_DOWN_SLOTS) * d_shape.bytes, d_shape, e < 0 ? sdown : down.expert(e, H, I),
              (c + m * C) * 16, I, bar(3 + MF_GU_SLOTS + q % MF_DOWN_SLOTS));
  };
  auto d_issue_ring = [&]() {  // warp 1
    fence_proxy_async_shared();
    for (int q = 0; q < min(MF_DOWN_SLOTS, d_ring_items); ++q) d_issue(q);
  };
  if (warp == 0) {
    fence_proxy_async_shared();
    for (int q = 0; q < min(MF_GU_SLOTS, gu_ring_items); ++q) gu_issue(q);
  } else if (warp == 1 && (MF_DOWN_EARLY || gu_items == 0)) {
    d_issue_ring();
  }

  // 3. gate/up: quad q takes items 2r + q of round r
  const int quad = warp / MF_QUAD, wq = warp % MF_QUAD;
  float* red_q = red + quad * MF_QUAD * 4 * 32;
  const u32 x_row = g < T ? smem_addr(s.x + g * s.pitch) : 0u;
  for (int i0 = 0; i0 < gu_items; i0 += 2) {
    const int i = i0 + quad;
    if (i < gu_items) {
      u32 slot = pre_gu;
      if (i < gu_pre) {
        mbarrier_wait_parity(bar(1), 0);
      } else {
        const int q = i - gu_pre;
        slot = gu_ring + (q % MF_GU_SLOTS) * gu_shape.bytes;
        mbarrier_wait_parity(bar(3 + q % MF_GU_SLOTS), (q / MF_GU_SLOTS) & 1);
      }
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      slot_partial<MF_QUAD, MF_UNROLL>(acc, slot, gu_shape, x_row, H, wq, sh);
#pragma unroll
      for (int k = 0; k < 4; ++k) red_q[(wq * 4 + k) * 32 + lane] = acc[k];
    }
    __syncthreads();
    if (!MF_DOWN_EARLY && i0 == 0 && warp == 1) d_issue_ring();
    if (warp == 0)  // the slots this round read, refilled
      for (int k = max(i0, gu_pre); k < min(i0 + 2, gu_items); ++k)
        if (k - gu_pre + MF_GU_SLOTS < gu_ring_items) gu_issue(k - gu_pre + MF_GU_SLOTS);
    const int tq = threadIdx.x % (MF_QUAD * 32), j = tq >> 3, b = tq & 7;
    if (i < gu_items && j < 8 && b < T) {  // moe_gate_up's epilogue
      int tile;
      const int e = gu_expert(i, tile);
      int slot = e < 0 ? A : -1;
      for (int a = 0; a < A && slot < 0; ++a)
        if (route_ids[b * A + a] == e) slot = a;
      if (slot >= 0) {
        const float gv = tile_sum<MF_QUAD>(red_q, j, b) * (e < 0 ? sgate.sum_scale() : gate.sum_scale(e));
        const float uv = tile_sum<MF_QUAD>(red_q, j + 8, b) * (e < 0 ? sup.sum_scale() : up.sum_scale(e));
        h[((size_t)b * (A + 1) + slot) * I + tile * 8 + j] = f32_to_bf16(silu(gv) * uv);
      }
    }
    __syncthreads();
  }

  if (threadIdx.x == 0) grid_barrier(counters, C);
  __syncthreads();
  pdl_launch_dependents();  // every CTA of ours is resident by now

  // 4. down: warp w runs moe_down's warps w and w + 8 over items f = u * steps + k-step
  const int steps = I / Nvfp4Weights::KSTEP, items = U * steps;
  for (int m = 0; m < d_tiles; ++m) {
    const int n0 = (c + m * C) * 16;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int p0 = 0; p0 < items; p0 += MF_DOWN_VW) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int f = p0 + warp + MF_WARPS * v;
        if (f < items) {
          const int u = f / steps, k = (f - u * steps) * Nvfp4Weights::KSTEP + t * Nvfp4Weights::LANE_K;
          u32 slot = pre_d;
          if (m == 0 && u == U - 1 && d_pre) {
            mbarrier_wait_parity(bar(2), 0);
          } else {
            const int q = d_ring_index(m, u);
            slot = d_ring + (q % MF_DOWN_SLOTS) * d_shape.bytes;
            mbarrier_wait_parity(bar(3 + MF_GU_SLOTS + q % MF_DOWN_SLOTS), (q / MF_DOWN_SLOTS) & 1);
          }
          const Nvfp4Frag fr = slot_frag(slot, d_shape, g, k);
          const int sl = slot_of[u][g];
          const Nvfp4Weights::X xv = sl >= 0 ? ld_cg_x(h + ((size_t)g * (A + 1) + sl) * I + k) : Nvfp4Weights::zero_x();
          float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          Nvfp4Weights::mma(part, fr, xv, sh);
          const float c_even = coef[u][2 * t], c_odd = coef[u][2 * t + 1];
          acc[v][0] = fmaf(c_even, part[0], acc[v][0]);
          acc[v][1] = fmaf(c_odd, part[1], acc[v][1]);
          acc[v][2] = fmaf(c_even, part[2], acc[v][2]);
          acc[v][3] = fmaf(c_odd, part[3], acc[v][3]);
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
