// NVFP4 expert GEMMs for decode-sized steps: few rows per expert (the grouped MoE's gate/up and down
// over rows sorted by expert, moe_routing.cu), each weight read from HBM and decoded once per item.
//
//   gate/up  h_sorted[r] = silu(x[sorted_token[r]] . Wg_e^T) * (x[..] . Wu_e^T)   [P, I]
//   down     y_sorted[r] = h_sorted[r] . Wd_e^T                                   [P, N]
//
// The "swap AB" mma of grouped_gemm.cu (weights as the m16 A operand, decoded in registers; an
// item's rows as n8 groups of B), with the per-weight work cut to the decode itself: the item's
// ED_ROWS activation rows are staged once per CTA in shared memory, already in the decode's pair
// order (x_j, x_{j+4}) and zero past the item's rows, so the k-loop reads B with one unpredicated
// LDS.128 at a constant offset per 16 weights and group; each warp streams whole 16-row tiles over
// all of K (no split-K reduction) and writes its outputs from the accumulators. grouped_gemm.cu's
// k-loop takes 4.0-5.1 SASS instructions per weight (x loads, permutes and zeroing per group,
// guards); this one ~2.8, of which the decode (mask, multiply, mask, scale per pair) is 2.1.
//
// Grid (items, tile groups): blockIdx.x = an item of the work list built with chunk ED_ROWS
// (expert e, first sorted row; e = E: the shared expert's own weights; items past num_work exit at
// once), blockIdx.y = ED_WARPS * ED_TILES (down: ED_TILES_DOWN) tiles of 16 weight rows: gate/up 8
// gate rows and the same 8 up rows (8 output columns; lane g holds the gate and up sums of column
// g), down 16 rows. With ED_GROUPS 2 the items have up to 16 rows (routing chunk 16) and an item of
// 8 or fewer runs the one-group code: an expert's weights are decoded once for up to 16 of its rows.
// A warp's work is a flat sequence of rounds (ED_KR = 512 weights of K for its tile's 16 rows; the
// next round's loads in flight while this one is computed). In a round lane (g, t) takes, at k-step
// u, the 32 weights kb + 128u + 32t .. of tile rows g and g + 8 (code word i: 8 of them), so the 4
// lanes of a row read 64 contiguous bytes of codes a load; the row's 32 scale bytes of the round
// come as one 8-byte load a lane, exchanged between the 4 (scales_of_lane).
//
// PDL as grouped_gemm.cu: gate/up waits first (its work list comes from the launch before) and then
// lets the down kernel start, which reads the work list and its first weights before its own wait.
#include "async_copy.cuh"  // cluster barriers
#include "expert_decode_trace.cuh"
#include "gemv_tile.cuh"  // nvfp4.cuh, silu

#ifndef ED_GROUPS
#define ED_GROUPS 1  // most 8-row groups per item (kernels/expert_decode.py); 2: an item of <= 8 rows runs one
#endif
#ifndef ED_TILES
#define ED_TILES 4  // 16-row tiles per warp
#endif
#ifndef ED_TILES_DOWN
#define ED_TILES_DOWN ED_TILES  // the down GEMM's (K = I: one round a tile)
#endif
#ifndef ED_PREFETCH
#define ED_PREFETCH 1  // 1: a warp loads its next round while computing this one
#endif
#ifndef ED_ACCS
#define ED_ACCS 1  // accumulators per group: 2 halves the chain of dependent mmas (parts alternate)
#endif
#ifndef ED_STAGE_LOADS
#define ED_STAGE_LOADS 4  // x chunks a thread loads at once while staging (1: one at a time)
#endif
#ifndef ED_MIN_CTAS
#define ED_MIN_CTAS 4
#endif
#ifndef ED_WARPS
#define ED_WARPS 4  // warps a CTA, sharing the item's staged x rows
#endif
#ifndef ED_DOWN_PAIRS
#define ED_DOWN_PAIRS 0  // 1: the one-launch kernel's down units take two items of an expert at once (below)
#endif
#ifndef ED_CLUSTER
#define ED_CLUSTER 0  // > 0: expert_decode_moe_cluster_nvfp4, an item's units as one cluster of this many CTAs (below)
#endif
#ifndef ED_PROBE
#define ED_PROBE 0  // timing probes, wrong results (benchmarks/bench_grouped.py --decode-probes): 1 leaves out
                    // the NVFP4 decode (code words straight into the MMAs), 2 the weight loads after a warp's
                    // first two rounds (later rounds reuse their registers)
#endif
#define ED_KR 512            // weights of K per round: 4 lanes x 4 k-steps x 32
#define ED_ROWS (ED_GROUPS * 8)
static_assert(ED_GROUPS == 1 || ED_GROUPS == 2, "items of one or two 8-row groups");
static_assert(!(ED_CLUSTER && ED_DOWN_PAIRS), "a cluster's CTAs take one item's units: no down pairs");
#define ED_TABLE_BYTES 1024  // the scale table, then the x rows

// x row r, 16-byte chunk c (elements 8c .. 8c + 7, pair order) at byte r * x_row_bytes(K) +
// x_slot(c) * 16, rows of 4 (mod 8) slots. Lane t reads chunks 4t + i + 16u + .. (i = 0..3), so the
// chunk's two low bits are XORed with bits 2-3: the 4 lanes t of a row hit 4 different 16-byte bank
// groups, and with rows 4 slots (mod 8) apart the 8 lanes of an LDS.128 phase (g = 2p, 2p + 1) hit
// 8 different ones.
__device__ __forceinline__ u32 x_slot(u32 c) { return c ^ ((c >> 2) & 3u); }
__device__ __forceinline__ u32 x_row_bytes(int K) {
  const u32 slots = (u32)K / 8;
  return (slots + ((4u - slots) & 7u)) * 16u;  // the next count = 4 (mod 8)
}


struct EdWeights {  // NVFP4 [rows, K] of one expert (or the shared one)
  const u8* codes;
  const u8* scales;
  const float* tensor_scale;
};

// Lane t of a 4-lane group loads the 8 scale bytes of blocks 8t .. 8t + 7 of its row's round (one
// 32-byte sector for the 4), which belong to k-step t of the 4 lanes (16 bits each); it needs
// k-step u's bytes of its own chunk from lane u. A 4 x 4 transpose of 16-bit elements over the lanes
// t (two exchanges): returns bytes 2u, 2u + 1 = the two blocks of the lane's chunk at k-step u.
__device__ __forceinline__ uint2 scales_of_lane(uint2 s, int t) {
  // lanes t, t ^ 2: lanes t < 2 keep their elements 0, 1 and get the partner's; lanes t >= 2 elements 2, 3
  const bool hi = t & 2;
  const u32 keep = hi ? s.y : s.x, recv = __shfl_xor_sync(0xFFFFFFFFu, hi ? s.x : s.y, 2);
  // lanes t, t ^ 1: each keeps element c = t & 1 of both words and sends the other to its partner
  const bool c = t & 1;
  const u32 mine = prmt(keep, recv, c ? 0x7632u : 0x5410u);  // lanes t, t ^ 2: k-steps t, t ^ 2
  const u32 got = __shfl_xor_sync(0xFFFFFFFFu, prmt(keep, recv, c ? 0x5410u : 0x7632u), 1);  // t ^ 1, t ^ 3
  // k-step u = t ^ d sits at byte base(d) of (mine, got): d = 0, 1, 2, 3 -> 0, 4, 2, 6
  auto sel = [](int d0, int d1) {
    const u32 b0 = (d0 & 1) * 4 + (d0 & 2), b1 = (d1 & 1) * 4 + (d1 & 2);
    return b0 | (b0 + 1) << 4 | b1 << 8 | (b1 + 1) << 12;
  };
  return make_uint2(prmt(mine, got, sel(t, t ^ 1)), prmt(mine, got, sel(t ^ 2, t ^ 3)));
}

struct EdRound {  // one round of a lane: 128 weights of tile rows g and g + 8
  uint4 c0[4], c1[4];  // code words, k-step u
  uint2 s0, s1;        // block scale bytes, block j = byte j
};

// One item of G 8-row groups (rows <= 8 G), after the scale table is in shared memory.
// tile_group: which ED_WARPS * TILES tiles (blockIdx.y of the two-kernel grid). ready (the fused
// kernel's down units): x is written during this launch, ready once ready[0 .. ready_items) all
// reach ready_count; the first weights are loaded before that wait and x is staged from L2, not
// through L1. CLUSTER (expert_decode_moe_cluster): a down unit waits as that at the cluster's barrier,
// which the caller arrived at after its gate/up unit; a gate/up unit stages x with the cluster's
// other CTAs. LOCAL_GATHER (the routed cluster kernel): gather is this CTA's shared-memory list of
// the item's tokens (gather[r] for row row0 + r), not the global sorted_token.
template <bool GATE_UP, int G, bool CLUSTER = false, bool LOCAL_GATHER = false>
__device__ __forceinline__ void expert_decode_item(u16* out, const u16* x, const int* gather, const EdWeights (&w)[4],
                                                   int expert, int row0, int rows, int N, int K, int E,
                                                   int tile_group, const int* ready, int ready_count,
                                                   int ready_items) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32* table = reinterpret_cast<const u32*>(smem);
  const u32 x_base = (u32)__cvta_generic_to_shared(smem) + ED_TABLE_BYTES;
  const u32 row_bytes = x_row_bytes(K);
  // a: gate (gate/up) or down rows, b: up rows; stacks are [E, N, K] (gate/up: N = I).
  EdWeights a = w[0], b = w[1];
  if (expert == E) {
    a = w[2], b = w[3];
  } else {
    const size_t ce = (size_t)expert * N * (K / 2), se = (size_t)expert * N * (K / 16);
    a = {a.codes + ce, a.scales + se, a.tensor_scale + expert};
    b = {b.codes + ce, b.scales + se, b.tensor_scale + expert};
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int R = GATE_UP ? 8 : 16;  // output columns per tile

  // This warp's tiles: first + ED_WARPS * j, j < tiles; `per_tile` rounds each.
  constexpr int TILES = GATE_UP ? ED_TILES : ED_TILES_DOWN;
  const int first = tile_group * ED_WARPS * TILES + warp;
  const int tiles = max(0, min(TILES, (N / R - first + ED_WARPS - 1) / ED_WARPS));  // warp-uniform
  const int per_tile = K / ED_KR, rounds = tiles * per_tile;
  auto load_round = [&](EdRound& f, int j, int kb) {
    const int r0 = (first + ED_WARPS * j) * R + g, r1 = GATE_UP ? r0 : r0 + 8;  // gate/up: gate and up row r0
    const EdWeights& w1 = GATE_UP ? b : a;
    // k-step u: bytes 64 u + 16 t (the 4 lanes of a row: 64 contiguous bytes, whole sectors; lane t
    // taking bytes 64 t .. 64 t + 63 instead read each sector as two halves, 45 % of the sectors in
    // excess by ncu)
    const u8* c0 = a.codes + (size_t)r0 * (K / 2) + kb / 2 + 16 * t;
    const u8* c1 = w1.codes + (size_t)r1 * (K / 2) + kb / 2 + 16 * t;
#pragma unroll
    for (int u = 0; u < 4; ++u) f.c0[u] = ld_stream_v4(c0 + 64 * u), f.c1[u] = ld_stream_v4(c1 + 64 * u);
    f.s0 = ld_stream_v2(a.scales + (size_t)r0 * (K / 16) + (kb + 128 * t) / 16);
    f.s1 = ld_stream_v2(w1.scales + (size_t)r1 * (K / 16) + (kb + 128 * t) / 16);
  };

  EdRound fa, fb;
  int load_j = 0, load_kb = 0, loads = 0;  // the next round to load; rounds loaded (ED_PROBE 2)
  auto next_load = [&](EdRound& f) {
    if (ED_PROBE != 2 || loads++ < 2) load_round(f, load_j, load_kb);
    load_kb += ED_KR;
    if (load_kb == K) load_kb = 0, ++load_j;
  };
  if (rounds > 0) next_load(fa);  // in flight while x is staged
  if (!GATE_UP) pdl_wait();       // h comes from the gate/up launch
  if (!GATE_UP && CLUSTER) cluster_wait_acquire();  // or from this cluster's gate/up units
  if (ready && threadIdx.x == 0)  // or from this one (the __syncthreads below releases the CTA)
    for (int i = 0; i < ready_items; ++i)
      while (ld_acquire_gpu(ready + i) < ready_count) __nanosleep(100);
  ed_mark(2);

  // Stage x: 8 G rows of K, pair order, zero past `rows`. The rows' sources first, then a thread's
  // chunks ED_STAGE_LOADS at a time, all in flight together (one L2 round trip per batch, not two
  // dependent ones per chunk).
  __shared__ int src_row[8 * G];
  if (threadIdx.x < 8 * G)
    src_row[threadIdx.x] = threadIdx.x >= rows ? -1
                           : !gather     ? row0 + threadIdx.x
                           : LOCAL_GATHER ? gather[threadIdx.x]
                                          : __ldcg(gather + row0 + threadIdx.x);
  __syncthreads();
  const int chunks = K / 8, total = 8 * G * chunks;
  // A gate/up unit of the cluster kernel: the cluster's CTAs load a share of the chunks each (CTA r:
  // blocks r, r + ED_CLUSTER, .. of blockDim chunks) and store them into every CTA's rows once all
  // have started: x read from L2 once a cluster, not once a CTA (9 tokens: the MoE layer 50.6 ->
  // 44.1 µs).
  constexpr int SHARES = GATE_UP && CLUSTER ? ED_CLUSTER : 1;
  u32 dst[SHARES];
  int stage_first = threadIdx.x;
  if constexpr (SHARES > 1) {
    stage_first += (int)cluster_ctarank() * blockDim.x;
#pragma unroll
    for (int q = 0; q < SHARES; ++q) dst[q] = cluster_map(x_base, q);
    cluster_arrive_relaxed();
    cluster_wait_acquire();
  } else {
    dst[0] = x_base;
  }
  for (int base = stage_first; base < total; base += SHARES * ED_STAGE_LOADS * blockDim.x) {
    uint4 v[ED_STAGE_LOADS];
#pragma unroll
    for (int j = 0; j < ED_STAGE_LOADS; ++j) {
      const int idx = base + j * SHARES * blockDim.x, r = idx / chunks;
      const int src = idx < total ? src_row[r] : -1;
      const u16* p = x + (size_t)src * K + 8 * (idx - r * chunks);
      v[j] = src < 0                  ? make_uint4(0, 0, 0, 0)
             : ready || CLUSTER ? __ldcg(reinterpret_cast<const uint4*>(p))
                                : ld_act_v4(p);
    }
#pragma unroll
    for (int j = 0; j < ED_STAGE_LOADS; ++j) {
      const int idx = base + j * SHARES * blockDim.x, r = idx / chunks;
      if (idx >= total) break;
      u32 p[4];
      x_pairs_for_e2m1(v[j], p);
      const u32 at = r * row_bytes + x_slot(idx - r * chunks) * 16u;
      if constexpr (SHARES > 1) {
#pragma unroll
        for (int q = 0; q < SHARES; ++q) st_cluster_v4(dst[q] + at, make_uint4(p[0], p[1], p[2], p[3]));
      } else {
        sts_v4(dst[0] + at, make_uint4(p[0], p[1], p[2], p[3]));
      }
    }
  }
  if constexpr (SHARES > 1) {  // every CTA's share stored
    cluster_arrive_release();
    cluster_wait_acquire();
  }
  __syncthreads();
  ed_mark(3);

  // Lane (g, t)'s x in group 0, round kb, part (u, i): chunk kb/8 + 16u + 4t + i at slot chunk ^ t,
  // byte 2 kb + 256 u + 64 t + 16 (i ^ t).
  const u32 x_lane = x_base + g * row_bytes + 64u * t;
  const float scale_a = __ldg(a.tensor_scale) * NVFP4_SUM_SCALE;
  const float scale_b = GATE_UP ? __ldg(b.tensor_scale) * NVFP4_SUM_SCALE : scale_a;
  float acc[ED_ACCS][G][4];
  int comp_j = 0, comp_kb = 0;  // the round to compute
  auto compute = [&](const EdRound& f) {
    if (comp_kb == 0) {
#pragma unroll
      for (int a2 = 0; a2 < ED_ACCS; ++a2)
#pragma unroll
        for (int grp = 0; grp < G; ++grp)
          acc[a2][grp][0] = acc[a2][grp][1] = acc[a2][grp][2] = acc[a2][grp][3] = 0.0f;
    }
    const u32 xr = x_lane + (u32)comp_kb * 2u;
    const uint2 s0 = scales_of_lane(f.s0, t), s1 = scales_of_lane(f.s1, t);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u32 words0[4] = {f.c0[u].x, f.c0[u].y, f.c0[u].z, f.c0[u].w};
      const u32 words1[4] = {f.c1[u].x, f.c1[u].y, f.c1[u].z, f.c1[u].w};
      // blocks 2u (words 0, 1) and 2u + 1 (words 2, 3) of the lane's 8
      const u32 sw0 = u < 2 ? s0.x : s0.y, sw1 = u < 2 ? s1.x : s1.y;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int byte = (2 * u + (i >> 1)) & 3;
        u32 p0[4], p1[4];
        if (ED_PROBE == 1) {
#pragma unroll
          for (int j = 0; j < 4; ++j) p0[j] = words0[i], p1[j] = words1[i];
        } else {
          const u32 sc0 = table[(sw0 >> (8 * byte)) & 0xFFu], sc1 = table[(sw1 >> (8 * byte)) & 0xFFu];
          e2m1x8_to_bf16(words0[i], sc0, p0);
          e2m1x8_to_bf16(words1[i], sc1, p1);
        }
#pragma unroll
        for (int grp = 0; grp < G; ++grp) {
          const uint4 xv = lds_v4(xr + grp * 8 * row_bytes + 256 * u + 16 * (i ^ t));
          float (&d)[4] = acc[i % ED_ACCS][grp];
          mma_bf16_16x8x16(d, p0[0], p1[0], p0[1], p1[1], xv.x, xv.y);
          mma_bf16_16x8x16(d, p0[2], p1[2], p0[3], p1[3], xv.z, xv.w);
        }
      }
    }
    comp_kb += ED_KR;
    if (comp_kb < K) return;
    // The tile's last round: acc[0][grp] = {row g, row g + 8} x {tokens 2t, 2t + 1} of group grp.
    const int tile = first + ED_WARPS * comp_j;
    comp_kb = 0, ++comp_j;
#pragma unroll
    for (int a2 = 1; a2 < ED_ACCS; ++a2)
#pragma unroll
      for (int grp = 0; grp < G; ++grp)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[0][grp][j] += acc[a2][grp][j];
#pragma unroll
    for (int grp = 0; grp < G; ++grp)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = grp * 8 + 2 * t + q;
        if (r >= rows) continue;
        u16* orow = out + (size_t)(row0 + r) * N + tile * R + g;
        if (GATE_UP) {
          orow[0] = f32_to_bf16(silu(acc[0][grp][q] * scale_a) * (acc[0][grp][2 + q] * scale_b));
        } else {
          orow[0] = f32_to_bf16(acc[0][grp][q] * scale_a);
          orow[8] = f32_to_bf16(acc[0][grp][2 + q] * scale_a);
        }
      }
  };

#if ED_PREFETCH
  // One copy of the round's code, the next round's registers moved (two unrolled bodies swapping
  // fa and fb made the one-launch kernel's text 189 KB for g2w8t4p: 16 % of its not-issued stall
  // samples were "no instructions"; one body, 118 KB, -3 to -5 % a step at 16-256 requests)
#pragma unroll 1
  for (int q = 0; q < rounds; ++q) {
    if (q + 1 < rounds) next_load(fb);
    compute(fa);
    fa = fb;
  }
  ed_mark(4);
#else
#pragma unroll 1
  for (int q = 0; q < rounds; ++q) {
    if (q > 0) next_load(fa);
    compute(fa);
  }
  (void)fb;
  ed_mark(4);
#endif
}

// One item's tiles of one tile group (or with ED_DOWN_PAIRS, a down unit's two items: rows up to
// 2 ED_ROWS).
template <bool GATE_UP, bool CLUSTER = false, bool LOCAL_GATHER = false>
__device__ __forceinline__ void expert_decode_unit(u16* out, const u16* x, const int* gather, const EdWeights (&w)[4],
                                                   int expert, int row0, int rows, int N, int K, int E,
                                                   int tile_group, const int* ready = nullptr, int ready_count = 0,
                                                   int ready_items = 1) {
#if ED_DOWN_PAIRS
  if (!GATE_UP && rows > ED_ROWS)
    return expert_decode_item<false, 2 * ED_GROUPS>(out, x, gather, w, expert, row0, rows, N, K, E, tile_group,
                                                    ready, ready_count, ready_items);
#endif
#if ED_GROUPS == 2
  // Items of up to 16 rows (routing chunk 16): one of 8 or fewer decodes for one group only.
  if (rows > 8)
    return expert_decode_item<GATE_UP, 2, CLUSTER, LOCAL_GATHER>(out, x, gather, w, expert, row0, rows, N, K, E,
                                                                 tile_group, ready, ready_count, ready_items);
#endif
  expert_decode_item<GATE_UP, 1, CLUSTER, LOCAL_GATHER>(out, x, gather, w, expert, row0, rows, N, K, E, tile_group,
                                                        ready, ready_count, ready_items);
}

template <bool GATE_UP>
__device__ __forceinline__ void expert_decode(u16* out, const u16* x, const int* gather, const EdWeights (&w)[4],
                                              const int* offsets, const int* work_expert, const int* work_row,
                                              const int* num_work, int N, int K, int E) {
  extern __shared__ __align__(16) unsigned char smem[];
  u32* table = reinterpret_cast<u32*>(smem);  // ue4m3_scale_bf16x2 of every scale byte
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = ue4m3_scale_bf16x2(i);
  ed_trace_begin(nullptr);  // the two-launch kernels are not traced

  if (GATE_UP) pdl_wait();
  pdl_launch_dependents();
  const int item = blockIdx.x;
  if (item >= __ldcg(num_work)) return;
  const int expert = __ldcg(work_expert + item), row0 = __ldcg(work_row + item);
  const int rows = min(ED_ROWS, __ldcg(offsets + expert + 1) - row0);
  expert_decode_unit<GATE_UP>(out, x, gather, w, expert, row0, rows, N, K, E, blockIdx.y);
}

#define ED_KERNEL extern "C" __global__ void __launch_bounds__(ED_WARPS * 32, ED_MIN_CTAS)
#define Q_ARGS(p) const u8 *p##_codes, const u8 *p##_scales, const float *p##_tensor_scale
#define Q(p) EdWeights{p##_codes, p##_scales, p##_tensor_scale}
#define WORK_ARGS const int *offsets, const int *work_expert, const int *work_row, const int *num_work
#define WORK offsets, work_expert, work_row, num_work

// Argument order as grouped_gemm.cu's grouped_moe_*_nvfp4 (kernels/expert_decode.py).
ED_KERNEL expert_decode_gate_up_nvfp4(u16* h, const u16* x, const int* sorted_token, Q_ARGS(g), Q_ARGS(u),
                                      Q_ARGS(sg), Q_ARGS(su), WORK_ARGS, int I, int K, int E) {
  const EdWeights w[4] = {Q(g), Q(u), Q(sg), Q(su)};
  expert_decode<true>(h, x, sorted_token, w, WORK, I, K, E);
}

ED_KERNEL expert_decode_down_nvfp4(u16* y, const u16* h, Q_ARGS(d), Q_ARGS(sd), WORK_ARGS, int N, int K, int E) {
  const EdWeights w[4] = {Q(d), Q(d), Q(sd), Q(sd)};
  expert_decode<false>(y, h, nullptr, w, WORK, N, K, E);
}

// ---- gate/up and down in one launch (kernels/expert_decode.py expert_decode_moe) ----------------
// Each CTA takes its unit from a queue as it starts (queue[0]; queue[1 + i] counts the gate/up
// units of item i done; the routing launch zeroes both): units are first every item's gate/up tile
// groups, then every item's down tile groups. A down unit loads its first weights, waits until its
// item's gate/up units are done, then stages its h rows from L2. Units are numbered in the order
// CTAs start, not by blockIdx, so every gate/up unit a down unit waits for belongs to a CTA already
// running, which waits on nothing: no deadlock, whatever order the hardware starts CTAs in. Down
// units thus run in the gate/up GEMM's last partial wave, and no launch boundary separates the two
// GEMMs. One unit a CTA (a loop over units would hold its state across both GEMMs' bodies: spills
// at G = 2).
// ED_DOWN_PAIRS: the down units of an item at an even chunk of its expert also take the next item's
// rows (the same expert's next ED_ROWS rows: the next item of the work list, whose counter sits
// next to this one's), decoding each down weight once for up to 2 ED_ROWS rows (at 256 tokens the
// shared expert's 256 rows are 16 items, a heavy expert's 55-77 rows 4-5); the odd item's down
// units exit at once. The x rows of a pair (K = I) take less shared memory than gate/up's (K = H).

ED_KERNEL expert_decode_moe_nvfp4(u16* y, u16* h, const u16* x, const int* sorted_token, Q_ARGS(g), Q_ARGS(u),
                                  Q_ARGS(sg), Q_ARGS(su), Q_ARGS(d), Q_ARGS(sd), WORK_ARGS, int* queue,
                                  int I, int H, int E ED_TRACE_PARAM) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int unit_s;
  ed_trace_begin(ED_TRACE_ARG);
  u32* table = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = ue4m3_scale_bf16x2(i);
  pdl_wait();  // the work list and the queue come from the routing launch
  pdl_launch_dependents();
  const int items = __ldcg(num_work);
  const int gate_up_groups = (I / 8 + ED_WARPS * ED_TILES - 1) / (ED_WARPS * ED_TILES);
  const int down_groups = (H / 16 + ED_WARPS * ED_TILES_DOWN - 1) / (ED_WARPS * ED_TILES_DOWN);
  const int gate_up_units = items * gate_up_groups;
  if (blockIdx.x >= items * (gate_up_groups + down_groups)) return;  // the grid is sized for the most items
  if (threadIdx.x == 0) unit_s = atomicAdd(queue, 1);  // the CTAs left take units 0, 1, ... as they start
  __syncthreads();
  const int unit = unit_s;
  ed_mark(1);
  ed_record(ED_TRACE_UNIT, unit);
  const bool is_gate_up = unit < gate_up_units;
  const int rel = is_gate_up ? unit : unit - gate_up_units, groups = is_gate_up ? gate_up_groups : down_groups;
  const int item = rel / groups, tile_group = rel - item * groups;
  const int expert = __ldcg(work_expert + item), row0 = __ldcg(work_row + item);
  const int rows = min(ED_ROWS, __ldcg(offsets + expert + 1) - row0);
  if (is_gate_up) {
    const EdWeights w[4] = {Q(g), Q(u), Q(sg), Q(su)};
    expert_decode_unit<true>(h, x, sorted_token, w, expert, row0, rows, I, H, E, tile_group);
#if TICKET_ACQ_REL  // the CTA's h stores, through the barrier, before the count (release)
    __syncthreads();
    if (threadIdx.x == 0) ticket_arrive(reinterpret_cast<u32*>(queue + 1 + item));
#else
    __threadfence();  // this thread's h stores, before the item's count
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(queue + 1 + item, 1);
#endif
    ed_mark(5);
    return;
  }
  const EdWeights w[4] = {Q(d), Q(d), Q(sd), Q(sd)};
#if ED_DOWN_PAIRS
  const int first_row = __ldcg(offsets + expert), end = __ldcg(offsets + expert + 1);
  if (((row0 - first_row) / ED_ROWS) & 1) return;  // the pair's first item takes these rows
  const int pair_rows = min(2 * ED_ROWS, end - row0);
  expert_decode_unit<false>(y, h, nullptr, w, expert, row0, pair_rows, H, I, E, tile_group, queue + 1 + item,
                            gate_up_groups, pair_rows > ED_ROWS ? 2 : 1);
#else
  expert_decode_unit<false>(y, h, nullptr, w, expert, row0, rows, H, I, E, tile_group, queue + 1 + item,
                            gate_up_groups);
#endif
  ed_mark(5);
}

#if ED_CLUSTER
#include "expert_decode_cluster.cuh"  // expert_decode_moe_cluster_nvfp4, expert_decode_moe_routed_nvfp4
#endif
