// Grouped skinny GEMMs on tensor cores ("swap AB", gemv_tile.cuh) for any number of rows M:
//   dense          y[M, N] = x[M, K] . W^T (+ residual), bf16 or fp32 out
//   dense gate/up  h[M, I] = silu(x . Wg^T) * (x . Wu^T)
//   MoE gate/up    h_sorted[r] = silu(x[sorted_token[r]] . Wg_e^T) * (x[..] . Wu_e^T)
//   MoE down       y_sorted[r] = h_sorted[r] . Wd_e^T
// e = the expert of sorted row r (E: the shared expert's own weights); metadata: moe_routing.cu.
//
// Grid (items, tile groups), blockIdx.x = item: <= GROUPED_CHUNK consecutive rows of one expert
// (the work list; dense: rows item * CHUNK ..), so the items of one expert run side by side and
// re-read its weights from L2. A CTA of GG_WARPS warps owns GROUPED_TILES tiles of 16 weight rows
// (gate/up: 8 gate + 8 up rows, SiLU.up in the epilogue); warp w takes tile w % TILES and the
// k-steps ks, ks + KSPLIT, ... (ks = w / TILES), loads each weight fragment once, decodes it once
// (NVFP4) and multiplies it into every 8-row group of the item:
//
//   acc[grp] = D[16 weight rows][rows grp*8 .. grp*8+7 of the item]   lane g = lane / 4 feeds row grp*8+g
//
// Partials are summed over the k-split warps in warp order (deterministic), and an mma column
// depends only on its own x row, so a row's result does not depend on the other rows of its item.
//
// PDL: dense kernels and MoE down trigger first; MoE gate/up triggers only after its wait, so
// when MoE down starts the routing kernel (two launches back) is complete and down reads the
// work list before its own wait (its first weight loads then overlap gate/up's tail). Weights
// are loaded before the wait; x, h, gather rows and residuals only after it.
#include "gemv_tile.cuh"

#ifndef GROUPED_CHUNK
#define GROUPED_CHUNK 64  // rows per item: 16 or 64 (kernels/grouped.py CHUNKS)
#endif
#ifndef GROUPED_TILES
#define GROUPED_TILES 1  // 16-row tiles per CTA: 1 (warps split K) or 4 (one tile per warp)
#endif
#define GG_WARPS 4
#define GG_KSPLIT (GG_WARPS / GROUPED_TILES)
#define GG_GROUPS (GROUPED_CHUNK / 8)
// The three below may be overridden by defines (kernels/grouped.py TUNING, for experiments).
#ifndef GG_MIN_CTAS
#define GG_MIN_CTAS (GG_GROUPS > 2 ? 3 : 4)
#endif
#ifndef BF16_UNROLL
#define BF16_UNROLL 4
#endif
#ifndef NVFP4_UNROLL
#define NVFP4_UNROLL (GG_GROUPS > 2 ? 2 : 4)  // CHUNK 64: 4 spilled at 3 CTAs per SM
#endif

// Decode-once view of gemv_tile.cuh's fragments: a k-step has N parts; part i yields the A
// registers of two m16n8k16 mmas and takes the 16 bytes of x at k + 8 i.
template <class Wt>
struct Parts;

template <>
struct Parts<Bf16Weights> {
  static constexpr int N = 1;
  static __device__ void decode(u32 (&a)[8], const Bf16Frag& f, int, const Bf16Weights::Shared&) {
    a[0] = f.w0.x, a[1] = f.w1.x, a[2] = f.w0.y, a[3] = f.w1.y;
    a[4] = f.w0.z, a[5] = f.w1.z, a[6] = f.w0.w, a[7] = f.w1.w;
  }
  static __device__ void mma(float (&acc)[4], const u32 (&a)[8], const uint4& x) {
    mma_bf16_16x8x16(acc, a[0], a[1], a[2], a[3], x.x, x.y);
    mma_bf16_16x8x16(acc, a[4], a[5], a[6], a[7], x.z, x.w);
  }
};

template <>
struct Parts<Nvfp4Weights> {
  static constexpr int N = 4;  // code word i: weights k + 8i .. k + 8i + 7 (block i / 2)
  static __device__ void decode(u32 (&a)[8], const Nvfp4Frag& f, int i, const Nvfp4Weights::Shared& sh) {
    const u32 w0 = i == 0 ? f.c0.x : i == 1 ? f.c0.y : i == 2 ? f.c0.z : f.c0.w;
    const u32 w1 = i == 0 ? f.c1.x : i == 1 ? f.c1.y : i == 2 ? f.c1.z : f.c1.w;
    const u32 s0 = sh.scale[(i >> 1) ? (f.s0 >> 8) : (f.s0 & 0xFFu)];
    const u32 s1 = sh.scale[(i >> 1) ? (f.s1 >> 8) : (f.s1 & 0xFFu)];
    u32 p0[4], p1[4];
    e2m1x8_to_bf16(w0, s0, p0);
    e2m1x8_to_bf16(w1, s1, p1);
    a[0] = p0[0], a[1] = p1[0], a[2] = p0[1], a[3] = p1[1];
    a[4] = p0[2], a[5] = p1[2], a[6] = p0[3], a[7] = p1[3];
  }
  static __device__ void mma(float (&acc)[4], const u32 (&a)[8], const uint4& x) {
    u32 xp[4];
    x_pairs_for_e2m1(x, xp);
    mma_bf16_16x8x16(acc, a[0], a[1], a[2], a[3], xp[0], xp[1]);
    mma_bf16_16x8x16(acc, a[4], a[5], a[6], a[7], xp[2], xp[3]);
  }
};

enum Kind { DENSE = 0, DENSE_GATE_UP = 1, MOE_GATE_UP = 2, MOE_DOWN = 3 };

struct WorkList {
  const int* offsets;  // [E + 2]
  const int* expert;   // [items]
  const int* row;      // [items]
  const int* count;    // [1]
};

// D[r][b] of tile `tl`, row group `grp`, summed over the k-split warps in order.
__device__ __forceinline__ float partial_sum(const float* red, int tl, int grp, int r, int b) {
  const int lane = (r & 7) * 4 + (b >> 1), i = ((r >> 3) << 1) | (b & 1);
  float s = 0.0f;
#pragma unroll
  for (int ks = 0; ks < GG_KSPLIT; ++ks)
    s += red[(((ks * GROUPED_TILES + tl) * GG_GROUPS + grp) * 4 + i) * 32 + lane];
  return s;
}

// wa/wb: the weight (dense), gate/up (dense gate/up) or the expert stacks (MoE; wb unused for
// down); sa/sb: the shared expert's. N: output columns (I for gate/up). gather: x row of each
// output row (MoE gate/up) or nullptr (row r reads x row r). Dense NVFP4 W may be up to three
// weights stacked by rows (q/k/v), each with its tensor scale: rows [split1, split2) use
// tensor_scale[1], rows from split2 on tensor_scale[2] (as gemv.cu).
template <class Wt, int U, Kind KIND>
__device__ __forceinline__ void grouped(void* out, int out_f32, const u16* x, const int* gather,
                                        const Wt& wa, const Wt& wb, const Wt& sa, const Wt& sb,
                                        const u16* residual, const WorkList& work, int M, int N,
                                        int K, int E, int split1 = 0x7FFFFFFF, int split2 = 0x7FFFFFFF) {
  constexpr bool GATE_UP = KIND == DENSE_GATE_UP || KIND == MOE_GATE_UP;
  constexpr bool MOE = KIND == MOE_GATE_UP || KIND == MOE_DOWN;
  constexpr int R = GATE_UP ? 8 : 16;  // outputs per tile
  __shared__ float red[GG_WARPS * GG_GROUPS * 4 * 32];
  __shared__ typename Wt::Shared sh;
  Wt::init_shared(sh);
  bool waited = false;
  if (KIND == MOE_GATE_UP) {
    pdl_wait();
    waited = true;
  }
  pdl_launch_dependents();
  int expert = 0, row0, rows;
  if (MOE) {  // MOE_DOWN: before its wait, see the header
    const int item = blockIdx.x;
    if (item >= __ldcg(work.count)) return;
    expert = __ldcg(work.expert + item);
    row0 = __ldcg(work.row + item);
    rows = min(GROUPED_CHUNK, __ldcg(work.offsets + expert + 1) - row0);
  } else {
    row0 = blockIdx.x * GROUPED_CHUNK;
    rows = min(GROUPED_CHUNK, M - row0);
  }
  Wt a = wa, b = GATE_UP ? wb : wa;
  if (MOE) {
    a = expert == E ? sa : wa.expert(expert, N, K);
    b = GATE_UP ? (expert == E ? sb : wb.expert(expert, N, K)) : a;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tl = warp % GROUPED_TILES, ks = warp / GROUPED_TILES;
  if (!MOE && blockIdx.x == 0 && threadIdx.x < GROUPED_TILES) {  // later items hit L2
    const int n = (blockIdx.y * GROUPED_TILES + threadIdx.x) * R;
    if (n < N) {
      a.prefetch(n, min(R, N - n), K);
      if (GATE_UP) b.prefetch(n, min(R, N - n), K);
    }
  }
  const int n0 = (blockIdx.y * GROUPED_TILES + tl) * R;
  const typename Wt::Rows wrows = GATE_UP
      ? Wt::rows(a, min(n0 + g, N - 1), b, min(n0 + g, N - 1), K)
      : Wt::rows(a, min(n0 + g, N - 1), a, min(n0 + g + 8, N - 1), K);
  const int groups = (rows + 7) >> 3;
  __syncthreads();  // sh

  u32 xoff[GG_GROUPS];  // element offset of the x row lane g feeds in each group; ~0u: none
  auto x_rows = [&]() {
#pragma unroll
    for (int grp = 0; grp < GG_GROUPS; ++grp) {
      const int c = grp * 8 + g;
      xoff[grp] = c < rows ? (u32)(gather ? gather[row0 + c] : row0 + c) * (u32)K : ~0u;
    }
  };
  if (waited) x_rows();
  float acc[GG_GROUPS][4];
#pragma unroll
  for (int grp = 0; grp < GG_GROUPS; ++grp) acc[grp][0] = acc[grp][1] = acc[grp][2] = acc[grp][3] = 0.0f;
  const int steps = (K + Wt::KSTEP - 1) / Wt::KSTEP;
  for (int s0 = ks; s0 < steps; s0 += GG_KSPLIT * U) {
    typename Wt::Frag f[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // all weight loads of the round first
      const int s = s0 + u * GG_KSPLIT, k = s * Wt::KSTEP + t * Wt::LANE_K;
      f[u] = (s < steps && k < K) ? Wt::load(wrows, k) : Wt::zero();
    }
    if (!waited) {
      pdl_wait();
      waited = true;
      x_rows();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * GG_KSPLIT, k = s * Wt::KSTEP + t * Wt::LANE_K;
      if (s >= steps) continue;
#pragma unroll
      for (int part = 0; part < Parts<Wt>::N; ++part) {
        uint4 xv[GG_GROUPS];
#pragma unroll
        for (int grp = 0; grp < GG_GROUPS; ++grp)
          xv[grp] = (grp < groups && xoff[grp] != ~0u && k < K) ? ld_act_v4(x + xoff[grp] + k + 8 * part)
                                                              : make_uint4(0, 0, 0, 0);
        u32 w[8];
        Parts<Wt>::decode(w, f[u], part, sh);
#pragma unroll
        for (int grp = 0; grp < GG_GROUPS; ++grp)
          if (grp < groups) Parts<Wt>::mma(acc[grp], w, xv[grp]);
      }
    }
  }
  if (!waited) pdl_wait();  // a warp with no k-steps

#pragma unroll
  for (int grp = 0; grp < GG_GROUPS; ++grp)
    if (grp < groups)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[((warp * GG_GROUPS + grp) * 4 + i) * 32 + lane] = acc[grp][i];
  __syncthreads();
  const float scale_a = a.sum_scale(), scale_b = b.sum_scale();
  // Output (row c, tile tj, column j), j fastest: a row's columns of all tiles are contiguous.
  for (int idx = threadIdx.x; idx < rows * GROUPED_TILES * R; idx += blockDim.x) {
    const int j = idx % R, rest = idx / R, tj = rest % GROUPED_TILES, c = rest / GROUPED_TILES;
    const int n = (blockIdx.y * GROUPED_TILES + tj) * R + j;
    if (n >= N) continue;
    float v;
    if (GATE_UP) {
      const float gate = partial_sum(red, tj, c >> 3, j, c & 7) * scale_a;
      const float up = partial_sum(red, tj, c >> 3, j + 8, c & 7) * scale_b;
      v = silu(gate) * up;
    } else {
      v = partial_sum(red, tj, c >> 3, j, c & 7) * (KIND == DENSE ? a.sum_scale((n >= split1) + (n >= split2))
                                                                   : scale_a);
    }
    const size_t o = (size_t)(row0 + c) * N + n;
    if (residual) v += bf16_to_f32(residual[o]);
    if (out_f32)
      static_cast<float*>(out)[o] = v;
    else
      static_cast<u16*>(out)[o] = f32_to_bf16(v);
  }
}

#define GG_KERNEL extern "C" __global__ void __launch_bounds__(GG_WARPS * 32, GG_MIN_CTAS)
#define NVFP4(p) Nvfp4Weights{p##_codes, p##_scales, p##_tensor_scale}
#define NVFP4_ARGS(p) const u8 *p##_codes, const u8 *p##_scales, const float *p##_tensor_scale
#define NO_WORK WorkList{nullptr, nullptr, nullptr, nullptr}

GG_KERNEL grouped_linear_bf16(void* out, int out_f32, const u16* x, const u16* w, const u16* residual,
                              int M, int N, int K) {
  const Bf16Weights wt{w};
  grouped<Bf16Weights, BF16_UNROLL, DENSE>(out, out_f32, x, nullptr, wt, wt, wt, wt, residual, NO_WORK, M, N,
                                           K, 0);
}

GG_KERNEL grouped_linear_nvfp4(void* out, int out_f32, const u16* x, NVFP4_ARGS(w), const u16* residual,
                               int M, int N, int K, int split1, int split2) {
  const Nvfp4Weights wt = NVFP4(w);
  grouped<Nvfp4Weights, NVFP4_UNROLL, DENSE>(out, out_f32, x, nullptr, wt, wt, wt, wt, residual, NO_WORK, M,
                                             N, K, 0, split1, split2);
}

GG_KERNEL grouped_gate_up_bf16(u16* h, const u16* x, const u16* wg, const u16* wu, int M, int I, int K) {
  const Bf16Weights g{wg}, u{wu};
  grouped<Bf16Weights, BF16_UNROLL, DENSE_GATE_UP>(h, 0, x, nullptr, g, u, g, u, nullptr, NO_WORK, M, I, K, 0);
}

GG_KERNEL grouped_gate_up_nvfp4(u16* h, const u16* x, NVFP4_ARGS(g), NVFP4_ARGS(u), int M, int I, int K) {
  const Nvfp4Weights gw = NVFP4(g), uw = NVFP4(u);
  grouped<Nvfp4Weights, NVFP4_UNROLL, DENSE_GATE_UP>(h, 0, x, nullptr, gw, uw, gw, uw, nullptr, NO_WORK, M, I,
                                                     K, 0);
}

GG_KERNEL grouped_moe_gate_up_bf16(u16* h, const u16* x, const int* sorted_token, const u16* gate,
                                   const u16* up, const u16* shared_gate, const u16* shared_up,
                                   const int* offsets, const int* work_expert, const int* work_row,
                                   const int* num_work, int I, int K, int E) {
  grouped<Bf16Weights, BF16_UNROLL, MOE_GATE_UP>(
      h, 0, x, sorted_token, Bf16Weights{gate}, Bf16Weights{up}, Bf16Weights{shared_gate},
      Bf16Weights{shared_up}, nullptr, WorkList{offsets, work_expert, work_row, num_work}, 0, I, K, E);
}

GG_KERNEL grouped_moe_gate_up_nvfp4(u16* h, const u16* x, const int* sorted_token, NVFP4_ARGS(g),
                                    NVFP4_ARGS(u), NVFP4_ARGS(sg), NVFP4_ARGS(su), const int* offsets,
                                    const int* work_expert, const int* work_row, const int* num_work,
                                    int I, int K, int E) {
  grouped<Nvfp4Weights, NVFP4_UNROLL, MOE_GATE_UP>(
      h, 0, x, sorted_token, NVFP4(g), NVFP4(u), NVFP4(sg), NVFP4(su), nullptr,
      WorkList{offsets, work_expert, work_row, num_work}, 0, I, K, E);
}

GG_KERNEL grouped_moe_down_bf16(u16* y, const u16* h, const u16* down, const u16* shared_down,
                                const int* offsets, const int* work_expert, const int* work_row,
                                const int* num_work, int N, int K, int E) {
  const Bf16Weights d{down}, sd{shared_down};
  grouped<Bf16Weights, BF16_UNROLL, MOE_DOWN>(y, 0, h, nullptr, d, d, sd, sd, nullptr,
                                              WorkList{offsets, work_expert, work_row, num_work}, 0, N, K, E);
}

GG_KERNEL grouped_moe_down_nvfp4(u16* y, const u16* h, NVFP4_ARGS(d), NVFP4_ARGS(sd), const int* offsets,
                                 const int* work_expert, const int* work_row, const int* num_work, int N,
                                 int K, int E) {
  const Nvfp4Weights dw = NVFP4(d), sdw = NVFP4(sd);
  grouped<Nvfp4Weights, NVFP4_UNROLL, MOE_DOWN>(y, 0, h, nullptr, dw, dw, sdw, sdw, nullptr,
                                                WorkList{offsets, work_expert, work_row, num_work}, 0, N, K, E);
}
