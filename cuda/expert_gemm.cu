// Tiled expert GEMMs for large token counts (prefill chunks): the grouped MoE's gate/up and down
// over rows sorted by expert (moe_routing.cu), for M-tiles of EG_BM rows:
//
//   gate/up  h_sorted[r] = silu(x[sorted_token[r]] . Wg_e^T) * (x[..] . Wu_e^T)   [P, I]
//   down     y_sorted[r] = h_sorted[r] . Wd_e^T                                   [P, N]
//
// Grid (n-tiles, items): blockIdx.y = an item of the routing work list built with chunk EG_BM
// (expert e, first sorted row; e = E: the shared expert's own weights), so an M-tile never spans
// two experts and ends where its expert's rows end; items past num_work exit at once.
// blockIdx.x = the CTA's EG_BN weight rows (gate/up: EG_BN/2 gate rows + the same EG_BN/2 up rows,
// so a thread holds matching gate and up sums and SiLU.up happens in registers).
//
// Classic smem-tiled mma.sync: EG_STAGES-deep cp.async ring of [EG_BM x 64] A tiles (gathered x
// rows, or h rows) and [EG_BN x 64] B tiles, 128-byte rows with the 16-byte chunks XOR-swizzled
// by (row & 7) so that ldmatrix and cp.async are conflict-free:
//
//   row r, chunk c (k = 8c .. 8c+7) lives at  r * 128 + ((c ^ (r & 7)) << 4)
//
// Warps: 2 along M x EG_BN/64 along N, each 64 rows x 64 B rows of m16n8k16 (acc[4][8][4] fp32);
// the M-warps take alternate 16-row groups. gate/up warp wn owns gate rows wn*32 .. +31 (its n8
// tiles 0-3) and the same up rows (4-7). Rows of a tail tile past the expert's count are
// zero-filled and their mmas skipped per 16 rows.
//
// NVFP4: the stage holds the packed codes [EG_BN x 32 B] and block scales [EG_BN x 4 B] of the
// k-tile; one thread per weight row decodes them (nvfp4.cuh's exact bf16 block values * 2^-7)
// into a swizzled bf16 tile one k-tile ahead of the mmas, a 16-weight block between k-steps (two
// such tiles, one barrier per k-tile); the fp32 sums are scaled by tensor_scale * 2^7 in the
// epilogue (as grouped_gemm.cu).
#include "async_copy.cuh"
#include "nvfp4.cuh"
#include "wgmma.cuh"

#ifndef EG_BN
#define EG_BN 256  // weight rows per CTA: 128 or 256 (kernels/expert_gemm.py CONFIGS)
#endif
#ifndef EG_STAGES
#define EG_STAGES 4
#endif
#ifndef EG_MIN_CTAS
#define EG_MIN_CTAS 1
#endif
#ifndef EG_WGMMA
#define EG_WGMMA 0  // 1: warpgroup MMAs (wgmma) from the shared tiles, EG_BN 256 only (see expert_gemm_wgmma)
#endif
#ifndef EG_SWAP
#define EG_SWAP 0  // 1 (EG_WGMMA only): items of <= 64 rows on swap-AB tiles (expert_gemm_wgmma)
#endif
#ifndef EG_PROBE
#define EG_PROBE 0  // timing probes, wrong results (benchmarks/bench_expert_gemm.py --probes): with EG_WGMMA,
                    // 1 leaves out the NVFP4 decode, 2 the MMAs, 3 the global loads after the prologue's
#endif
#define EG_BM 128  // rows per M-tile = the routing chunk (kernels/expert_gemm.py TILE_M)
#define EG_BK 64
#define EG_WARPS_N (EG_BN / 64)
#ifndef EG_WIDE
#define EG_WIDE 0  // 1: 512 threads, every item on swap-AB tiles, NVFP4 only (see expert_gemm_wgmma)
#endif
// One thread per weight row in the NVFP4 decode; EG_WIDE: two per row, a half k-tile each.
#define EG_THREADS (EG_WIDE ? 512 : 2 * EG_WARPS_N * 32)
#define EG_A_BYTES (EG_BM * 128)
#define EG_B_BYTES (EG_BN * 128)

__device__ __forceinline__ float eg_silu(float v) { return v / (1.0f + expf(-v)); }

struct Bf16B {
  const u16* w;  // [N, K] of this expert
};
struct Nvfp4B {
  const u8* codes;   // [N, K/2]
  const u8* scales;  // [N, K/16]
  const float* tensor_scale;
};

// The CTA's B rows: gate/up rows n < EG_BN/2 from `a` (gate), the rest from `b` (up), each at
// weight row n0 + (n mod EG_BN/2); down: all from `a`, weight row n0 + n.
// EG_WIDE gate/up: each 64-row slice interleaves 8 gate and the same 8 up rows per 16 (so a thread's
// accumulator rows g and g + 8 are a gate and its up): row n -> output column 32 (n / 64) +
// 8 ((n / 16) % 4) + n % 8, from `b` (up) when (n / 8) is odd.
template <bool GATE_UP>
__device__ __forceinline__ int b_source_row(int n, int n0, bool& from_b) {
  if (EG_WIDE && GATE_UP) {
    from_b = (n >> 3) & 1;
    return n0 + 32 * (n >> 6) + 8 * ((n >> 4) & 3) + (n & 7);
  }
  from_b = GATE_UP && n >= EG_BN / 2;
  return n0 + (from_b ? n - EG_BN / 2 : n);
}

// Warp (wm, wn) owns the 16-row groups 2 mi + wm (mi < 4) of the tile, interleaved so that a
// tail tile's real rows split evenly between the two M-warps (a 64-row tail costs half a tile),
// and 64 B rows (b_group_row). mi_valid: groups holding real rows (warp-uniform).
__device__ __forceinline__ int m_group_row(int mi, int wm) { return (2 * mi + wm) * 16; }

// First B row of n8 tiles 2p, 2p+1 of warp wn: gate/up p = 0, 1 gate rows, p = 2, 3 the same up rows.
template <bool GATE_UP>
__device__ __forceinline__ int b_group_row(int p, int wn) {
  return GATE_UP ? (p >> 1) * (EG_BN / 2) + wn * 32 + (p & 1) * 16 : wn * 64 + p * 16;
}

struct Frags {
  u32 a[4][4];  // m16 x k16 A fragments of the warp's groups
  u32 b[8][2];  // k16 x n8 B fragments
};

template <bool GATE_UP>
__device__ __forceinline__ void load_frags(Frags& f, u32 a_base, u32 b_base, int kk, int wm, int wn, int lane,
                                           int mi_valid) {
  const int b_row_in = ((lane >> 4) << 3) + (lane & 7);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    u32 r[4];
    ldmatrix_x4(r, b_base + sw128(b_group_row<GATE_UP>(p, wn) + b_row_in, kk * 2 + ((lane >> 3) & 1)));
    f.b[2 * p][0] = r[0], f.b[2 * p][1] = r[1], f.b[2 * p + 1][0] = r[2], f.b[2 * p + 1][1] = r[3];
  }
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
    if (mi < mi_valid) ldmatrix_x4(f.a[mi], a_base + sw128(m_group_row(mi, wm) + (lane & 15), kk * 2 + (lane >> 4)));
}

__device__ __forceinline__ void mma_frags(float (&acc)[4][8][4], const Frags& f, int mi_valid) {
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
    if (mi < mi_valid)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
        mma_bf16_16x8x16(acc[mi][ni], f.a[mi][0], f.a[mi][1], f.a[mi][2], f.a[mi][3], f.b[ni][0], f.b[ni][1]);
}

// NVFP4: block kk (weights 16 kk .. 16 kk + 15) of raw row n of a k-tile -> bf16 chunks 2 kk, 2 kk + 1
// of the swizzled tile at dst (nvfp4.cuh's exact block values * 2^-7, back in k order).
__device__ __forceinline__ void decode_block(u32 dst, const u8* raw_codes, const u8* raw_scales, const u32* table,
                                             int n, int kk) {
  const uint2 c = *reinterpret_cast<const uint2*>(raw_codes + n * 32 + kk * 8);
  const u32 scale = table[raw_scales[n * 4 + kk]];
  const u32 words[2] = {c.x, c.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {  // word w: weights 8w .. 8w+7 of the block
    u32 p[4];                    // (w_j, w_{j+4}) pairs
    e2m1x8_to_bf16(words[w], scale, p);
    const uint4 v = make_uint4(prmt(p[0], p[1], 0x5410u), prmt(p[2], p[3], 0x5410u), prmt(p[0], p[1], 0x7632u),
                               prmt(p[2], p[3], 0x7632u));
    sts_v4(dst + sw128(n, 2 * kk + w), v);
  }
}

// This thread's share of decoding a k-tile's raw stage into the bf16 tile at dst: all four blocks of
// row tid, or (EG_WIDE) two blocks of row tid % EG_BN.
__device__ __forceinline__ void decode_tile(u32 dst, const unsigned char* raw, const u32* table, int tid) {
  if (EG_PROBE == 1) return;
  if (EG_THREADS == EG_BN) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) decode_block(dst, raw, raw + EG_BN * 32, table, tid, kk);
  } else {
    const int n = tid % EG_BN, kk = 2 * (tid / EG_BN);
    decode_block(dst, raw, raw + EG_BN * 32, table, n, kk);
    decode_block(dst, raw, raw + EG_BN * 32, table, n, kk + 1);
  }
}

// One k-tile: acc += A[warp's groups, 64 k] . B[warp's 64 rows, 64 k]^T, the fragments of k-step
// kk + 1 loaded while kk's mmas run. NVFP4 with `decode`: block kk of the next k-tile's raw row
// (this thread's) is decoded into dec_dst between them, so the integer work overlaps the mmas.
template <bool GATE_UP, bool FP4>
__device__ __forceinline__ void compute_tile(float (&acc)[4][8][4], u32 a_base, u32 b_base, int wm, int wn,
                                             int lane, int mi_valid, const unsigned char* raw, u32 dec_dst,
                                             const u32* table, bool decode) {
  Frags f[2];
  load_frags<GATE_UP>(f[0], a_base, b_base, 0, wm, wn, lane, mi_valid);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if (kk < 3) load_frags<GATE_UP>(f[(kk + 1) & 1], a_base, b_base, kk + 1, wm, wn, lane, mi_valid);
    if (FP4 && decode) decode_block(dec_dst, raw, raw + EG_BN * 32, table, threadIdx.x, kk);
    mma_frags(acc, f[kk & 1], mi_valid);
  }
}

#include "expert_gemm_wgmma.cuh"

template <bool GATE_UP, bool FP4>
__device__ __forceinline__ void expert_gemm(u16* out, const u16* act, const int* gather, const Bf16B* wb,
                                            const Nvfp4B* wq, const int* offsets, const int* work_expert,
                                            const int* work_row, const int* num_work, int N, int K, int E) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // stage s: A [EG_BM][128 B] then B: bf16 [EG_BN][128 B] or codes [EG_BN][32 B] + scales [EG_BN][4 B];
  // wgmma: every tile 1024-byte aligned (the 128-byte swizzle's period), the launcher adds 1 KB.
  constexpr int STAGE_B = FP4 ? EG_BN * 36 : EG_B_BYTES;
  constexpr int STAGE = EG_WGMMA ? (EG_A_BYTES + STAGE_B + 1023) / 1024 * 1024 : EG_A_BYTES + STAGE_B;
  constexpr int DECODED = EG_WGMMA ? 3 : 2;  // FP4: decoded bf16 B tiles in rotation
  const u32 base = EG_WGMMA ? (smem_addr(smem_raw) + 1023u) & ~1023u : smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
  const u32 dec_base = base + EG_STAGES * STAGE;  // FP4: the decoded bf16 B tiles, then the scale table
  u32* table = reinterpret_cast<u32*>(smem + EG_STAGES * STAGE + DECODED * EG_B_BYTES);

  pdl_launch_dependents();
  pdl_wait();
  const int item = blockIdx.y;
  if (item >= __ldcg(num_work)) return;
  const int expert = __ldcg(work_expert + item), row0 = __ldcg(work_row + item);
  const int rows = min(EG_BM, __ldcg(offsets + expert + 1) - row0);
  const int tid = threadIdx.x;
  const int n0 = blockIdx.x * (GATE_UP ? EG_BN / 2 : EG_BN);  // first output column / weight row
  const bool shared_expert = expert == E;
  if (FP4)
    for (int i = tid; i < 256; i += EG_THREADS) table[i] = ue4m3_scale_bf16x2(i);

  // A: thread -> chunk tid & 7 of rows (tid >> 3) + i * EG_THREADS / 8.
  constexpr int A_ITERS = EG_BM * 8 / EG_THREADS;
  u32 a_off[A_ITERS];  // element offset of the source row; rows past the count read row 0, zero-filled
  u32 a_valid = 0;
#pragma unroll
  for (int i = 0; i < A_ITERS; ++i) {
    const int r = (tid >> 3) + i * (EG_THREADS / 8);
    const bool ok = r < rows;
    a_off[i] = ok ? (u32)(gather ? __ldcg(gather + row0 + r) : row0 + r) * (u32)K : 0u;
    a_valid |= (u32)ok << i;
  }
  const u16* act_k = act + (tid & 7) * 8;

  // B sources: bf16 thread -> chunk tid & 7 of rows (tid >> 3) + i * EG_BN / 8 (i < 4: the first
  // half, gate for gate/up); NVFP4 thread -> all of row tid.
  const size_t rows_per_expert = N;  // stacks: gate/up [E, I, K], down [E, N, K]
  const u16* b_lo = nullptr;
  const u16* b_hi = nullptr;
  const u8* q_codes = nullptr;
  const u8* q_scales = nullptr;
  float sum_scale_a = 1.0f, sum_scale_b = 1.0f;
  if (!FP4) {
    const u16* wa = shared_expert ? wb[2].w : wb[0].w + (size_t)expert * rows_per_expert * K;
    const u16* wbb = GATE_UP ? (shared_expert ? wb[3].w : wb[1].w + (size_t)expert * rows_per_expert * K) : wa;
    bool hi;
    const int ra = b_source_row<GATE_UP>(tid >> 3, n0, hi);
    b_lo = wa + (size_t)ra * K + (tid & 7) * 8;
    const int rb = b_source_row<GATE_UP>((tid >> 3) + EG_BN / 2, n0, hi);
    b_hi = (hi ? wbb : wa) + (size_t)rb * K + (tid & 7) * 8;
  } else {
    const Nvfp4B qa = shared_expert ? wq[2]
                                    : Nvfp4B{wq[0].codes + (size_t)expert * rows_per_expert * (K / 2),
                                             wq[0].scales + (size_t)expert * rows_per_expert * (K / 16),
                                             wq[0].tensor_scale + expert};
    Nvfp4B qb = qa;
    if (GATE_UP)
      qb = shared_expert ? wq[3]
                         : Nvfp4B{wq[1].codes + (size_t)expert * rows_per_expert * (K / 2),
                                  wq[1].scales + (size_t)expert * rows_per_expert * (K / 16),
                                  wq[1].tensor_scale + expert};
    bool hi;
    const int r = b_source_row<GATE_UP>(tid % EG_BN, n0, hi);
    const Nvfp4B& q = hi ? qb : qa;
    q_codes = q.codes + (size_t)r * (K / 2);
    q_scales = q.scales + (size_t)r * (K / 16);
    sum_scale_a = __ldg(qa.tensor_scale) * NVFP4_SUM_SCALE;
    sum_scale_b = __ldg(qb.tensor_scale) * NVFP4_SUM_SCALE;
  }

  auto load_tile = [&](int kt, int stage) {
    if (EG_PROBE == 3 && kt >= EG_STAGES - 2) return;  // later tiles reuse stale stages
    const u32 sa = base + stage * STAGE, sb = sa + EG_A_BYTES;
    const int k = kt * EG_BK;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int r = (tid >> 3) + i * (EG_THREADS / 8);
      cp_async_16(sa + sw128(r, tid & 7), act_k + a_off[i] + k, (a_valid >> i) & 1u ? 16u : 0u);
    }
    if (!FP4) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = (tid >> 3) + i * (EG_BN / 8);
        const u16* src = (i < 4 ? b_lo : b_hi) + (size_t)((i & 3) * (EG_BN / 8)) * K + k;
        cp_async_16(sb + sw128(r, tid & 7), src, 16u);
      }
    } else {
      if (EG_THREADS == EG_BN) {
        cp_async_16(sb + tid * 32, q_codes + k / 2, 16u);
        cp_async_16(sb + tid * 32 + 16, q_codes + k / 2 + 16, 16u);
        cp_async_4(sb + EG_BN * 32 + tid * 4, q_scales + k / 16);
      } else {  // EG_WIDE: row tid % EG_BN, half tid / EG_BN of its codes; the first half's threads the scales
        const int n = tid % EG_BN, h = tid / EG_BN;
        cp_async_16(sb + n * 32 + 16 * h, q_codes + k / 2 + 16 * h, 16u);
        if (h == 0) cp_async_4(sb + EG_BN * 32 + n * 4, q_scales + k / 16);
      }
    }
  };
  auto raw_stage = [&](int stage) { return smem + stage * STAGE + EG_A_BYTES; };

#if EG_WGMMA
#define EG_RUN(TN)                                                                                            \
  expert_gemm_wgmma<GATE_UP, FP4, TN>(out, smem, base, dec_base, table, load_tile, raw_stage, row0, rows, n0, \
                                      sum_scale_a, sum_scale_b, N, K)
  if (EG_SWAP && rows <= 16)
    EG_RUN(16);
  else if (EG_SWAP && rows <= 32)
    EG_RUN(32);
  else if (EG_SWAP && rows <= 64)
    EG_RUN(64);
  else
    EG_RUN(EG_WIDE ? 128 : 0);
#undef EG_RUN
#else
  const int lane = tid & 31, wm = (tid >> 5) / EG_WARPS_N, wn = (tid >> 5) % EG_WARPS_N;
  float acc[4][8][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.0f;
  const int mi_valid = max(0, min(4, (rows - wm * 16 + 31) >> 5));  // groups 2 mi + wm below `rows`
  const int KT = K / EG_BK;

#pragma unroll
  for (int s = 0; s < EG_STAGES - 1; ++s) {
    if (s < KT) load_tile(s, s);
    cp_async_commit();
  }
  if (!FP4) {
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<EG_STAGES - 2>();  // tile kt has landed (this thread's copies) ...
      __syncthreads();                 // ... and everyone's; stage (kt - 1) % S is free again
      if (kt + EG_STAGES - 1 < KT) load_tile(kt + EG_STAGES - 1, (kt + EG_STAGES - 1) % EG_STAGES);
      cp_async_commit();
      const u32 sa = base + (kt % EG_STAGES) * STAGE;
      compute_tile<GATE_UP, false>(acc, sa, sa + EG_A_BYTES, wm, wn, lane, mi_valid, nullptr, 0u, nullptr, false);
    }
  } else {
    // Decode one k-tile ahead: iteration kt decodes tile kt + 1 into buffer (kt + 1) & 1 while
    // the mmas read tile kt's buffer, decoded (and made visible by this barrier) one iteration ago.
    cp_async_wait<EG_STAGES - 2>();
    __syncthreads();  // the scale table, tile 0's raw bytes
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) decode_block(dec_base, raw_stage(0), raw_stage(0) + EG_BN * 32, table, tid, kk);
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<EG_STAGES - 3>();  // tile kt + 1 has landed
      __syncthreads();                 // buffer kt & 1 decoded; buffer (kt + 1) & 1 and stage (kt - 1) % S free
      if (kt + EG_STAGES - 1 < KT) load_tile(kt + EG_STAGES - 1, (kt + EG_STAGES - 1) % EG_STAGES);
      cp_async_commit();
      const u32 sa = base + (kt % EG_STAGES) * STAGE;
      compute_tile<GATE_UP, true>(acc, sa, dec_base + (kt & 1) * EG_B_BYTES, wm, wn, lane, mi_valid,
                                  raw_stage((kt + 1) % EG_STAGES), dec_base + ((kt + 1) & 1) * EG_B_BYTES, table,
                                  kt + 1 < KT);
    }
  }
  cp_async_wait<0>();

  // Epilogue straight from the accumulators: lane (g, t) holds rows g, g + 8 of each 16-row group
  // and columns 2t, 2t + 1 of each n8 tile.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    if (mi >= mi_valid) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m_group_row(mi, wm) + g + 8 * half;
      if (r >= rows) continue;
      u16* orow = out + (size_t)(row0 + r) * N;
      if (GATE_UP) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = n0 + wn * 32 + j * 8 + 2 * t;
          const float h0 = eg_silu(acc[mi][j][2 * half] * sum_scale_a) * (acc[mi][j + 4][2 * half] * sum_scale_b);
          const float h1 =
              eg_silu(acc[mi][j][2 * half + 1] * sum_scale_a) * (acc[mi][j + 4][2 * half + 1] * sum_scale_b);
          *reinterpret_cast<u32*>(orow + col) = pack_bf16x2(h0, h1);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const int col = n0 + wn * 64 + ni * 8 + 2 * t;
          *reinterpret_cast<u32*>(orow + col) =
              pack_bf16x2(acc[mi][ni][2 * half] * sum_scale_a, acc[mi][ni][2 * half + 1] * sum_scale_a);
        }
      }
    }
  }
#endif
}

#define EG_KERNEL extern "C" __global__ void __launch_bounds__(EG_THREADS, EG_MIN_CTAS)
#define Q_ARGS(p) const u8 *p##_codes, const u8 *p##_scales, const float *p##_tensor_scale
#define Q(p) Nvfp4B{p##_codes, p##_scales, p##_tensor_scale}
#define WORK_ARGS const int *offsets, const int *work_expert, const int *work_row, const int *num_work
#define WORK offsets, work_expert, work_row, num_work

// Argument order as grouped_gemm.cu's grouped_moe_* (kernels/grouped_moe.py builds both).
#if !EG_WIDE  // EG_WIDE kernels are NVFP4 only
EG_KERNEL expert_gate_up_bf16(u16* h, const u16* x, const int* sorted_token, const u16* gate, const u16* up,
                              const u16* shared_gate, const u16* shared_up, WORK_ARGS, int I, int K, int E) {
  const Bf16B w[4] = {{gate}, {up}, {shared_gate}, {shared_up}};
  expert_gemm<true, false>(h, x, sorted_token, w, nullptr, WORK, I, K, E);
}
#endif

EG_KERNEL expert_gate_up_nvfp4(u16* h, const u16* x, const int* sorted_token, Q_ARGS(g), Q_ARGS(u), Q_ARGS(sg),
                               Q_ARGS(su), WORK_ARGS, int I, int K, int E) {
  const Nvfp4B w[4] = {Q(g), Q(u), Q(sg), Q(su)};
  expert_gemm<true, true>(h, x, sorted_token, nullptr, w, WORK, I, K, E);
}

#if !EG_WIDE
EG_KERNEL expert_down_bf16(u16* y, const u16* h, const u16* down, const u16* shared_down, WORK_ARGS, int N, int K,
                           int E) {
  const Bf16B w[4] = {{down}, {down}, {shared_down}, {shared_down}};
  expert_gemm<false, false>(y, h, nullptr, w, nullptr, WORK, N, K, E);
}
#endif

EG_KERNEL expert_down_nvfp4(u16* y, const u16* h, Q_ARGS(d), Q_ARGS(sd), WORK_ARGS, int N, int K, int E) {
  const Nvfp4B w[4] = {Q(d), Q(d), Q(sd), Q(sd)};
  expert_gemm<false, true>(y, h, nullptr, nullptr, w, WORK, N, K, E);
}
