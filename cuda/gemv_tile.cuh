// Skinny GEMM tiles on tensor cores ("swap AB"): D[16 weight rows][8 tokens] += W . x^T.
//
// A CTA of W warps owns one tile of 16 weight rows (row0 = tile row g, row1 = tile row g + 8,
// g = lane / 4) for all <= 8 tokens; the warps split K by k-steps, interleaved so that they
// stream neighbouring bytes of the same rows:
//
//   row r: | step 0 | step 1 | ... | step W-1 | step W | ...      warp w: steps w, w+W, w+2W..
//          |t0|t1|t2|t3|                                          lane t = lane % 4: chunk t
//
// One k-step: each lane loads 16 bytes of row0 and 16 of row1 at its chunk (BF16: 8 weights,
// NVFP4: 32), plus the same k range of token g's activations (`X`, the mma B fragment, zero for
// g >= B). The k order inside a lane's chunk is permuted identically on both sides, so any
// pairing the decoder finds cheap is allowed. Partial sums are reduced across warps in shared
// memory in warp order, so results are deterministic.
#pragma once
#include "async_copy.cuh"  // bulk_copy_g2s (Nvfp4Staged::copy_rows)
#include "common.cuh"
#include "nvfp4.cuh"

// ---- BF16 weights: [N, K] row-major ----------------------------------------------------------

struct Bf16Rows {
  const u16* r0;  // start of the weight row at tile row g
  const u16* r1;  // ... at tile row g + 8
};

struct Bf16Frag {
  uint4 w0, w1;  // rows 0 and 1: k..k+7
};

struct Bf16Weights {
  static constexpr int KSTEP = 32;  // weights per row per warp k-step
  static constexpr int LANE_K = 8;  // weights per lane per k-step
  typedef Bf16Rows Rows;
  typedef Bf16Frag Frag;
  struct Shared {};

  const u16* w;

  static __device__ void init_shared(Shared&) {}

  __device__ Bf16Weights expert(int e, int n, int k) const { return {w + (size_t)e * n * k}; }
  __device__ float sum_scale(int = 0) const { return 1.0f; }
  static __device__ Rows rows(const Bf16Weights& a, int row_a, const Bf16Weights& b, int row_b,
                              int k_total) {
    return {a.w + (size_t)row_a * k_total, b.w + (size_t)row_b * k_total};
  }
  // L2 prefetch of rows [row, row + n) (contiguous); row * k_total * 2 is 16-byte aligned.
  __device__ void prefetch(int row, int n, int k_total) const {
    prefetch_l2(w + (size_t)row * k_total, (u32)n * k_total * 2);
  }
  static __device__ Frag load(const Rows& rows, int k) {
    return {ld_stream_v4(rows.r0 + k), ld_stream_v4(rows.r1 + k)};
  }
  static __device__ Frag zero() {
    const uint4 z = make_uint4(0, 0, 0, 0);
    return {z, z};
  }
  typedef uint4 X;  // token g's activations of one lane's k-step: 8 bf16
  static __device__ X load_x(const u16* xk) { return ld_act_v4(xk); }
  // x times a per-k weight (an RMSNorm's, folded into the GEMV: bf16 products, one rounding each)
  static __device__ X load_x_w(const u16* xk, const u16* wk) { return mul_bf16x2_v4(ld_act_v4(xk), __ldg(
      reinterpret_cast<const uint4*>(wk))); }
  static __device__ X zero_x() { return make_uint4(0, 0, 0, 0); }
  static __device__ void mma(float (&acc)[4], const Frag& f, const X& x, const Shared&) {
    mma_bf16_16x8x16(acc, f.w0.x, f.w1.x, f.w0.y, f.w1.y, x.x, x.y);
    mma_bf16_16x8x16(acc, f.w0.z, f.w1.z, f.w0.w, f.w1.w, x.z, x.w);
  }
  template <int G>  // one fragment into G 8-token groups
  static __device__ void mma_groups(float (&acc)[G][4], const Frag& f, const X (&x)[G], const Shared& sh) {
#pragma unroll
    for (int grp = 0; grp < G; ++grp) mma(acc[grp], f, x[grp], sh);
  }
};

// ---- NVFP4 weights: codes [N, K/2], block scales [N, K/16], tensor scale [1] -----------------

struct Nvfp4Rows {
  const u8* c0;  // codes of the weight row at tile row g (K/2 bytes)
  const u8* c1;  // ... at tile row g + 8
  const u8* s0;  // block scales of those rows (K/16 bytes)
  const u8* s1;
};

struct Nvfp4Frag {
  uint4 c0, c1;  // rows 0 and 1: codes of weights k..k+31
  u32 s0, s1;    // rows 0 and 1: scale bytes of blocks k/16 (low byte) and k/16 + 1 (high byte)
};

struct Nvfp4Weights {
  static constexpr int KSTEP = 128;
  static constexpr int LANE_K = 32;
  typedef Nvfp4Rows Rows;
  typedef Nvfp4Frag Frag;
  struct Shared {
    u32 scale[256];  // ue4m3_scale_bf16x2 of every scale byte: one LDS instead of ~8 ALU ops
  };

  const u8* codes;
  const u8* scales;
  const float* tensor_scale;

  // Every thread of the CTA calls this, then __syncthreads() before the first mma.
  static __device__ void init_shared(Shared& sh) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.scale[i] = ue4m3_scale_bf16x2(i);
  }

  __device__ Nvfp4Weights expert(int e, int n, int k) const {
    return {codes + (size_t)e * n * (k / 2), scales + (size_t)e * n * (k / 16), tensor_scale + e};
  }
  // What the fp32 sums are multiplied by (see nvfp4.cuh); i: the expert of a stack, or the row
  // segment of weights concatenated by rows (each part keeps its tensor scale).
  __device__ float sum_scale(int i = 0) const { return tensor_scale[i] * NVFP4_SUM_SCALE; }
  static __device__ Rows rows(const Nvfp4Weights& a, int row_a, const Nvfp4Weights& b, int row_b,
                              int k_total) {
    const size_t c = k_total / 2, s = k_total / 16;
    return {a.codes + row_a * c, b.codes + row_b * c, a.scales + row_a * s, b.scales + row_b * s};
  }
  // L2 prefetch of rows [row, row + n): codes and block scales (row a multiple of 8).
  __device__ void prefetch(int row, int n, int k_total) const {
    prefetch_l2(codes + (size_t)row * (k_total / 2), (u32)n * (k_total / 2));
    prefetch_l2(scales + (size_t)row * (k_total / 16), (u32)n * (k_total / 16));
  }
  static __device__ Frag load(const Rows& rows, int k) {
    return {ld_stream_v4(rows.c0 + k / 2), ld_stream_v4(rows.c1 + k / 2),
            ld_weight_u16(rows.s0 + k / 16), ld_weight_u16(rows.s1 + k / 16)};
  }
  static __device__ Frag zero() {
    const uint4 z = make_uint4(0, 0, 0, 0);
    return {z, z, 0u, 0u};
  }
  struct X {  // token g's activations of one lane's k-step: 32 bf16
    uint4 v[4];
  };
  static __device__ X load_x(const u16* xk) {
    X x;
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i] = ld_act_v4(xk + 8 * i);
    return x;
  }
  static __device__ X load_x_w(const u16* xk, const u16* wk) {  // as Bf16Weights::load_x_w
    X x;
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i] = ld_act_v4(xk + 8 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i] = mul_bf16x2_v4(x.v[i], __ldg(reinterpret_cast<const uint4*>(wk + 8 * i)));
    return x;
  }
  static __device__ X zero_x() {
    X x;
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i] = make_uint4(0, 0, 0, 0);
    return x;
  }
  // One fragment into G 8-token groups, each code word decoded once for all of them.
  template <int G>
  static __device__ void mma_groups(float (&acc)[G][4], const Frag& f, const X (&x)[G], const Shared& sh) {
    const u32 scale0[2] = {sh.scale[f.s0 & 0xFFu], sh.scale[f.s0 >> 8]};
    const u32 scale1[2] = {sh.scale[f.s1 & 0xFFu], sh.scale[f.s1 >> 8]};
    const u32 words0[4] = {f.c0.x, f.c0.y, f.c0.z, f.c0.w};
    const u32 words1[4] = {f.c1.x, f.c1.y, f.c1.z, f.c1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: weights k + 8i .. k + 8i + 7, block i / 2
      u32 p0[4], p1[4];
      e2m1x8_to_bf16(words0[i], scale0[i >> 1], p0);
      e2m1x8_to_bf16(words1[i], scale1[i >> 1], p1);
#pragma unroll
      for (int grp = 0; grp < G; ++grp) {
        u32 xp[4];
        x_pairs_for_e2m1(x[grp].v[i], xp);
        mma_bf16_16x8x16(acc[grp], p0[0], p1[0], p0[1], p1[1], xp[0], xp[1]);
        mma_bf16_16x8x16(acc[grp], p0[2], p1[2], p0[3], p1[3], xp[2], xp[3]);
      }
    }
  }
  static __device__ void mma(float (&acc)[4], const Frag& f, const X& x, const Shared& sh) {
    float a[1][4] = {{acc[0], acc[1], acc[2], acc[3]}};
    const X xs[1] = {x};
    mma_groups<1>(a, f, xs, sh);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = a[0][j];
  }
};

// ---- NVFP4 tiles staged in shared memory -------------------------------------------------------
// A 16-row tile's codes [16][K/2], then its scales [16][K/16] (9K bytes; bulk-copied as two
// contiguous ranges of the [N, K/2] and [N, K/16] tensors), read back as the same fragments as
// Nvfp4Weights reads from global memory: the same sums, bit for bit.

struct Nvfp4StagedRows {
  u32 c0, c1, s0, s1;  // shared addresses of tile rows g and g + 8: codes, scales
};

struct Nvfp4Staged : Nvfp4Weights {
  typedef Nvfp4StagedRows Rows;
  static __device__ Rows rows(u32 tile, int g, int k_total) {
    const u32 c = k_total / 2, s = k_total / 16, scales = tile + 16 * c;
    return {tile + g * c, tile + (g + 8) * c, scales + g * s, scales + (g + 8) * s};
  }
  static __device__ Frag load(const Rows& r, int k) {
    return {lds_v4(r.c0 + k / 2), lds_v4(r.c1 + k / 2), lds_u16(r.s0 + k / 16), lds_u16(r.s1 + k / 16)};
  }
  // One thread: rows [row0, row0 + n) of w into tile rows [first, first + n) of `tile`, two bulk
  // copies completing on `bar` (whose expected bytes the caller sets: 9K for a whole tile).
  static __device__ void copy_rows(u32 tile, int first, const Nvfp4Weights& w, int row0, int n, int k_total,
                                   u32 bar) {
    const u32 c = k_total / 2, s = k_total / 16;
    bulk_copy_g2s(tile + first * c, w.codes + (size_t)row0 * c, n * c, bar);
    bulk_copy_g2s(tile + 16 * c + first * s, w.scales + (size_t)row0 * s, n * s, bar);
  }
};

// ---- the tile loop ---------------------------------------------------------------------------

// X_BATCH (a compile-time define, 1 or 0): load a round's activations together before its mmas
// (fewest round trips: small batches), or each right before its mma (fewer registers, more CTAs
// per SM: NVFP4 at larger batches, where the FP4 decode's integer work wants the occupancy).
#ifndef X_BATCH
#define X_BATCH 1
#endif

// acc[grp] += this warp's share of rows . x_g[grp] over k-steps [s_begin, s_end), for G groups
// of 8 tokens (lane g feeds token grp * 8 + g of group grp; each weight fragment is loaded and
// decoded once for all groups). x_g[grp]: that token's activation row (K bf16), or nullptr.
// K % LANE_K == 0.
// PREFETCH: the caller has not waited on the previous kernel yet (PDL); the first round of weight
// loads is issued before `pdl_wait`, so it overlaps the previous kernel's tail, and every thread
// has waited when this returns. Weights never depend on the previous kernel; x does.
// XW: x is multiplied by xw [k_total] (bf16) on load, as Wt::load_x_w.
template <class Wt, int W, int U, bool PREFETCH = false, int G = 1, bool XW = false>
__device__ __forceinline__ void tile_partial_groups(float (&acc)[G][4], const typename Wt::Rows& rows,
                                                    const u16* const (&x_g)[G], int k_total, int s_begin,
                                                    int s_end, const typename Wt::Shared& sh,
                                                    const u16* xw = nullptr) {
  auto load_x = [&](const u16* xk, int k) {
    if constexpr (XW) {
      return Wt::load_x_w(xk, xw + k);
    } else {
      return Wt::load_x(xk);
    }
  };
  const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
  bool waited = !PREFETCH;
  for (int s0 = s_begin + warp; s0 < s_end; s0 += W * U) {
    typename Wt::Frag f[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // all loads first: U k-steps of bytes in flight per lane
      const int s = s0 + u * W;
      const int k = s * Wt::KSTEP + t * Wt::LANE_K;
      f[u] = (s < s_end && k < k_total) ? Wt::load(rows, k) : Wt::zero();
    }
    if (!waited) {
      pdl_wait();
      waited = true;
    }
    if (X_BATCH) {
      // Every activation load of the round first (L1/L2 hits, but one after another they cost a
      // round trip per k-step), then the mmas.
      typename Wt::X xv[U][G];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int s = s0 + u * W;
        const int k = s * Wt::KSTEP + t * Wt::LANE_K;
#pragma unroll
        for (int grp = 0; grp < G; ++grp)
          xv[u][grp] = (x_g[grp] && s < s_end && k < k_total) ? load_x(x_g[grp] + k, k) : Wt::zero_x();
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (s0 + u * W < s_end) Wt::template mma_groups<G>(acc, f[u], xv[u], sh);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int s = s0 + u * W;
        const int k = s * Wt::KSTEP + t * Wt::LANE_K;
        if (s < s_end) {
          typename Wt::X xv[G];
#pragma unroll
          for (int grp = 0; grp < G; ++grp)
            xv[grp] = (x_g[grp] && k < k_total) ? load_x(x_g[grp] + k, k) : Wt::zero_x();
          Wt::template mma_groups<G>(acc, f[u], xv, sh);
        }
      }
    }
  }
  if (!waited) pdl_wait();  // a warp with no k-steps
}

// One group of <= 8 tokens: acc += this warp's share of rows . x_g (see tile_partial_groups).
template <class Wt, int W, int U, bool PREFETCH = false>
__device__ __forceinline__ void tile_partial(float (&acc)[4], const typename Wt::Rows& rows,
                                             const u16* x_g, int k_total, int s_begin, int s_end,
                                             const typename Wt::Shared& sh) {
  float a[1][4] = {{acc[0], acc[1], acc[2], acc[3]}};
  const u16* const xs[1] = {x_g};
  tile_partial_groups<Wt, W, U, PREFETCH, 1>(a, rows, xs, k_total, s_begin, s_end, sh);
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = a[0][j];
}

// Partials of all warps: red[(warp * 4 + i) * 32 + lane], i = accumulator index.
template <int W>
__device__ __forceinline__ void tile_store_partials(float* red, const float (&acc)[4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 4; ++i) red[(warp * 4 + i) * 32 + lane] = acc[i];
}

// D[r][b] (tile row r < 16, token b < 8) summed over warps in order.
template <int W>
__device__ __forceinline__ float tile_sum(const float* red, int r, int b) {
  const int lane = (r & 7) * 4 + (b >> 1), i = ((r >> 3) << 1) | (b & 1);
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < W; ++w) s += red[(w * 4 + i) * 32 + lane];
  return s;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }
