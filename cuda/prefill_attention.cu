// Prefill attention with sinks: causal flash attention over the query chunks of several requests in
// one launch (online softmax, mma.sync bf16 tensor cores, fp32 accumulators), GQA packed: a tile's
// 128 rows are 16 tokens x the 8 query heads of one KV head, so each K/V tile serves all 8 heads.
//
//   row r of a tile = (token r / 8, head r % 8)     warp w owns rows 32w .. 32w+31 = tokens 4w .. 4w+3
//   lane (g = lane / 4, t = lane % 4) holds rows of head g, tokens 4w + {0, 1, 2, 3}
//
// Grid: one CTA per (tile, KV head), 1-D, heaviest tiles first (the host sorts `tiles`). Keys of a
// tile whose tokens sit at positions q_first .. q_first + 15 of a request whose chunk is
// [s, s + n):  full layers (window == 0): 0 .. min(q_last, s + n - 1), all read from the paged pool
// (the chunk's own K/V were written there first);  sliding layers: from max(0, q_first - window + 1),
// positions < s from the request's ring slot (history), positions >= s from the q/k/v buffer
// (fresh, normed and roped). Key tiles of 64 run from the last (the diagonal) down; masks only on
// tiles that cross the diagonal or the window's lower edge.
//
// Softmax in the log2 domain (x = s * scale * log2 e). The sink starts each row: m = sink * log2 e,
// l = 1 (a logit whose value vector is zero), so m is always finite and fully masked tiles add
// exact zeros; out = o / l.
//
// Pipeline (FlashAttention-2's): single K and V buffers; V(j) loads under Q.K(j) and the softmax,
// K(j-1) under P.V(j). Two CTAs per SM overlap each other's waits. On sm_90a the warp-specialized
// prefill_attention_wgmma_bf16 below (the same tiles and masks) runs instead.
#include "attention_common.cuh"

#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define PF_TOKENS 16                   // query tokens per tile (flint_sched/kernels/prefill_attention.py)
#define PF_ROWS (PF_TOKENS * GROUP)    // 128 (token, head) rows
#define PF_KEYS 64                     // keys per K/V tile

// NOTE: rows sit 272 B apart in shared memory (256 + 16 pad): the 8 row addresses of every
// ldmatrix fall in 8 distinct 16-byte bank groups (decode_attention.cu does the same).
constexpr int SROW = HEAD_DIM * 2 + 16;
constexpr int Q_SMEM = PF_ROWS * SROW;   // 34,816 B
constexpr int KV_SMEM = PF_KEYS * SROW;  // 17,408 B each for K and V
static_assert(Q_SMEM + 2 * KV_SMEM == 69632, "kernels/prefill_attention.py SMEM_BYTES");

__device__ __forceinline__ u32 srow(int row, int chunk) { return row * SROW + (chunk << 4); }

// 16 bytes global -> shared through L2 (cp.async.cg); `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Where the keys of one request live, for one KV head (see the header).
struct KeySource {
  const u16* qkv;       // the step's q/k/v rows, (H + 2G) * 128 per token
  const u16* k_pool;    // paged pool or ring of this layer
  const u16* v_pool;
  const int* table;     // this request's block table row (full layers), else null
  long long qkv_stride, pool_stride;  // elements per token row
  int ring_page, page_rows, s, row0, k_col, v_col, head_col;

  // Key (or value) row of position kp for this KV head: paged pool, ring (history) or q/k/v (fresh).
  __device__ __forceinline__ const u16* row(int kp, bool v) const {
    if (table) {
      const long long r = (long long)table[kp / page_rows] * page_rows + kp % page_rows;
      return (v ? v_pool : k_pool) + r * pool_stride + head_col;
    }
    if (kp < s) {
      const long long r = (long long)ring_page * page_rows + kp % page_rows;
      return (v ? v_pool : k_pool) + r * pool_stride + head_col;
    }
    return qkv + (long long)(row0 + kp - s) * qkv_stride + (v ? v_col : k_col) + head_col;
  }
};

// K or V rows k0 .. k0+63 into shared memory (rows past `hi` zeroed: finite, so masked P = 0
// times them stays 0). Thread: chunk tid % 16 of rows tid / 16 + 8i.
__device__ __forceinline__ void load_kv_tile(u32 dst, const KeySource& src, bool v, int k0, int hi, int tid) {
  const int c = tid & 15;
#pragma unroll
  for (int i = 0; i < PF_KEYS / 8; ++i) {
    const int kr = (tid >> 4) + 8 * i, kp = k0 + kr;
    const bool valid = kp <= hi;
    cp_async_16(dst + srow(kr, c), valid ? src.row(kp, v) + 8 * c : src.qkv, valid);
  }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2)
prefill_attention_bf16(u16* out, const u16* qkv, const u16* k_pool, const u16* v_pool, const int* block_tables,
                       int table_stride, int page_rows, int window, const int* entries, const int* tiles,
                       int num_q_heads, int num_kv_heads, const void* sinks, int sinks_bf16, float scale_log2) {
  extern __shared__ uint4 smem[];
  const int H = num_q_heads, G = num_kv_heads;
  const int kvh = blockIdx.x % G, tile = blockIdx.x / G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, gr = lane >> 2;
  const u32 q_smem = smem_addr(smem), k_smem = q_smem + Q_SMEM, v_smem = k_smem + KV_SMEM;
  pdl_launch_dependents();
  pdl_wait();  // q/k/v and the pool rows of this chunk come from the kernel before

  const int e = tiles[2 * tile], t0 = tiles[2 * tile + 1];
  if (e < 0) return;  // a padding tile of a captured prompt step (kernels/prefill_attention.py PrefillBuffers)
  const int row0 = entries[4 * e], s = entries[4 * e + 1], n = entries[4 * e + 2];
  const int n_q = min(PF_TOKENS, n - t0);              // real tokens in this tile
  const int q_first = s + t0, q_last = q_first + PF_TOKENS - 1;  // padded tokens keep their would-be positions
  const int hi = min(q_last, s + n - 1);
  const int lo = window > 0 ? max(0, q_first - window + 1) : 0;
  const int n_tiles = (hi - lo) / PF_KEYS + 1;

  // NOTE: kept in shared memory and read when a tile is issued: in registers it spilled (255 used).
  __shared__ KeySource src;
  if (tid == 0) {
    src.qkv = qkv, src.k_pool = k_pool, src.v_pool = v_pool;
    src.table = block_tables ? block_tables + (long long)e * table_stride : nullptr;
    src.qkv_stride = (long long)(H + 2 * G) * HEAD_DIM, src.pool_stride = (long long)G * HEAD_DIM;
    src.ring_page = entries[4 * e + 3], src.page_rows = page_rows, src.s = s, src.row0 = row0;
    src.k_col = H * HEAD_DIM, src.v_col = (H + G) * HEAD_DIM, src.head_col = kvh * HEAD_DIM;
  }
  __syncthreads();

  // Q: thread loads head tid / 16 (of the group), chunk tid % 16, of all 16 tokens (rows 8i + head).
  {
    const int hh = tid >> 4, c = tid & 15;
    const long long q_stride = (long long)(H + 2 * G) * HEAD_DIM;
    const u16* q_src = qkv + (long long)(row0 + t0) * q_stride + (kvh * GROUP + hh) * HEAD_DIM + 8 * c;
#pragma unroll
    for (int i = 0; i < PF_TOKENS; ++i)
      cp_async_16(q_smem + srow(8 * i + hh, c), i < n_q ? q_src + i * q_stride : qkv, i < n_q);
  }
  load_kv_tile(k_smem, src, false, lo + (n_tiles - 1) * PF_KEYS, hi, tid);
  cp_async_commit();

  const float sink2 = (sinks_bf16 ? bf16_to_f32(static_cast<const u16*>(sinks)[kvh * GROUP + gr])
                                  : static_cast<const float*>(sinks)[kvh * GROUP + gr]) * 1.4426950408889634f;
  // Rows of this lane: ri = 2a + half (a: 16-row m-atom, half: rows g / g + 8) = token 4w + ri.
  float m[4], l[4], o[2][16][4];
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) m[ri] = sink2, l[ri] = t == 0 ? 1.0f : 0.0f;  // quad sums l at the end
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int nn = 0; nn < 16; ++nn) o[a][nn][0] = o[a][nn][1] = o[a][nn][2] = o[a][nn][3] = 0.0f;
  const int my_q = q_first + 4 * warp;  // position of token 4w (row index ri adds to it)

  for (int j = n_tiles - 1; j >= 0; --j) {
    const int k0 = lo + j * PF_KEYS;
    cp_async_wait_all();
    __syncthreads();  // K(j) (and Q) landed; every warp is done with V(j+1)
    load_kv_tile(v_smem, src, true, k0, hi, tid);
    cp_async_commit();

    // S = Q K^T: 32 rows x 64 keys per warp; A = Q rows via ldmatrix, B = K rows (non-trans).
    float sc[2][8][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) sc[a][jj][0] = sc[a][jj][1] = sc[a][jj][2] = sc[a][jj][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // k-step: dims 16kk .. 16kk+15
      u32 qa[2][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
        ldmatrix_x4(qa[a], q_smem + srow(32 * warp + 16 * a + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {  // keys 16jp .. 16jp+15: n-tiles 2jp, 2jp+1
        u32 kb[4];
        ldmatrix_x4(kb, k_smem + srow(16 * jp + 8 * (lane >> 4) + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          mma_bf16_16x8x16(sc[a][2 * jp], qa[a][0], qa[a][1], qa[a][2], qa[a][3], kb[0], kb[1]);
          mma_bf16_16x8x16(sc[a][2 * jp + 1], qa[a][0], qa[a][1], qa[a][2], qa[a][3], kb[2], kb[3]);
        }
      }
    }

    // Masks: causal (key after the query) and the window's lower edge; only where a tile crosses them.
    if (k0 + PF_KEYS - 1 > q_first || (window > 0 && q_last - window + 1 > k0)) {
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int kp = k0 + 8 * jj + 2 * t + (x & 1), qp = my_q + 2 * a + (x >> 1);
            if (kp > qp || (window > 0 && qp - kp >= window)) sc[a][jj][x] = NEG_INF;
          }
    }

    // Online softmax per row: m, l and o rescaled by alpha = 2^(m_old - m_new).
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int ri = 2 * a + half;
        float mx = NEG_INF;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) mx = fmaxf(mx, fmaxf(sc[a][jj][2 * half], sc[a][jj][2 * half + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const float m_new = fmaxf(m[ri], mx * scale_log2);
        const float alpha = ex2(m[ri] - m_new);
        m[ri] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
          for (int x = 2 * half; x < 2 * half + 2; ++x) {
            sc[a][jj][x] = ex2(fmaf(sc[a][jj][x], scale_log2, -m_new));
            sum += sc[a][jj][x];
          }
        l[ri] = l[ri] * alpha + sum;
#pragma unroll
        for (int nn = 0; nn < 16; ++nn) o[a][nn][2 * half] *= alpha, o[a][nn][2 * half + 1] *= alpha;
      }

    cp_async_wait_all();
    __syncthreads();  // V(j) landed; every warp is done with K(j)
    if (j > 0) {
      load_kv_tile(k_smem, src, false, k0 - PF_KEYS, hi, tid);
      cp_async_commit();
    }

    // O += P V: P (bf16) straight from the S fragments as the A operand, B = V rows (ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 16 keys: n-tiles 2kk, 2kk+1 of S
      u32 pa[2][4];
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        pa[a][0] = pack_bf16x2(sc[a][2 * kk][0], sc[a][2 * kk][1]);
        pa[a][1] = pack_bf16x2(sc[a][2 * kk][2], sc[a][2 * kk][3]);
        pa[a][2] = pack_bf16x2(sc[a][2 * kk + 1][0], sc[a][2 * kk + 1][1]);
        pa[a][3] = pack_bf16x2(sc[a][2 * kk + 1][2], sc[a][2 * kk + 1][3]);
      }
#pragma unroll
      for (int n2 = 0; n2 < 8; ++n2) {  // 16 dims: n-tiles 2n2, 2n2+1 of O
        u32 vb[4];
        ldmatrix_x4_trans(vb, v_smem + srow(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * n2 + (lane >> 4)));
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mma_bf16_16x8x16(o[a][2 * n2 + h], pa[a][0], pa[a][1], pa[a][2], pa[a][3], vb[2 * h], vb[2 * h + 1]);
      }
    }
  }

  // out = o / l, staged as bf16 in this warp's own Q rows (no other warp reads them), then 16-byte
  // stores of whole rows: out[row0 + t0 + token][kvh * 8 + head].
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    l[ri] += __shfl_xor_sync(0xFFFFFFFFu, l[ri], 1);
    l[ri] += __shfl_xor_sync(0xFFFFFFFFu, l[ri], 2);
    l[ri] = 1.0f / l[ri];
  }
  __syncwarp();
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int nn = 0; nn < 16; ++nn)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float inv = l[2 * a + half];
        const u32 v = pack_bf16x2(o[a][nn][2 * half] * inv, o[a][nn][2 * half + 1] * inv);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(q_smem + srow(32 * warp + 16 * a + 8 * half + gr, nn) + 4 * t),
                     "r"(v) : "memory");
      }
  __syncwarp();
  const long long out_stride = (long long)H * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int idx = 32 * i + lane, r = 32 * warp + (idx >> 4), c = idx & 15, token = r >> 3;
    if (token < n_q) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(q_smem + srow(r, c)) : "memory");
      *reinterpret_cast<uint4*>(out + (long long)(row0 + t0 + token) * out_stride +
                                (kvh * GROUP + (r & 7)) * HEAD_DIM + 8 * c) = v;
    }
  }
}

// ---- the same attention on warpgroup MMAs (sm_90a) -------------------------------------------------
//
// prefill_attention_wgmma_bf16 (sm_90a): same arguments, grid and query tiles as
// prefill_attention_bf16, FlashAttention-3's design: 384 threads = a producer warpgroup that loads
// (cp.async into 128-byte-swizzled tiles, completing on mbarriers) and two consumer warpgroups of
// 64 rows each (tokens 8w .. 8w + 7 of the tile, all 8 heads) that only compute:
//
//   S(i) = Q K(i)^T     wgmma m64n128k16 x 8, Q and K K-major in shared memory
//   O += P(i-1) V(i-1)  wgmma m64n128k16 x 8, P from registers (A fragments), V MN-major: stored
//                       [key][dim] as the pool holds it, transposed by the instruction
//   softmax(S(i))       in registers while P(i-1) V(i-1) runs on the tensor cores
//
// Key tiles of 128 from the diagonal down, in PW_STAGES buffers; K and V of a stage have their own
// full / empty barriers, so K(i) is refilled as soon as S(i) is done. The two consumers take turns
// issuing their MMAs (named barriers 1 and 2), so one warpgroup's softmax runs under the other's
// MMAs (measured: 0-3 % over issuing freely). The producer looks up each key row's address once
// per tile (128 rows, one per thread; barrier 3 among the producers), then copies from the list.
// Registers: producer 40, consumers 232 (S 64 + O 64 + P 32 + ...).
// Thread (consumer warpgroup w, warp q, lane 4g + t): rows 16q + g and + 8 of the warpgroup's 64 =
// tokens 8w + 2q + {0, 1}, head g; columns 8j + 2t (+ 1) (the accumulator layout in wgmma.cuh).
#include "wgmma.cuh"

#define PW_THREADS 384
#define PW_KEYS 128
#define PW_STAGES 2
#define PW_Q_SUB (PF_ROWS * 128)   // 16 KB: 128 rows x 64 dims
#define PW_KV_SUB (PW_KEYS * 128)  // 16 KB: 128 keys x 64 dims
// Q (2 sub-tiles), then per stage K (2) and V (2), each 1024-byte aligned; the launcher adds 1 KB.
static_assert(2 * PW_Q_SUB + PW_STAGES * 4 * PW_KV_SUB == 163840, "kernels/prefill_attention.py WGMMA_SMEM_BYTES");

__device__ __forceinline__ u32 sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// The arrival counts once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

#ifndef PW_TMA
#define PW_TMA 0
#endif
#if PW_TMA
// A CUtensorMap (cuTensorMapEncodeTiled, kernels/prefill_attention.py `pool_tensor_map`): a paged
// pool [rows, G, 128] bf16 in boxes of 16 rows x 1 head x 64 dims, 128-byte swizzled, so a box lands
// exactly as sw128 lays out 16 rows of one sub-tile.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap& map, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// K or V rows k0 .. k0+127 of a full layer (whole 16-row pages, all before `hi`) by TMA: one thread
// expects the bytes and issues 8 pages x 2 halves; the other producers just arrive.
__device__ __forceinline__ void load_kv_tile_tma(u32 dst, const TensorMap& map, const int* table, int k0, int kvh,
                                                 u32 bar, int p) {
  if (p != 0) {
    mbarrier_arrive(bar);
    return;
  }
  mbarrier_arrive_expect_tx(bar, 2 * PW_KV_SUB);
#pragma unroll
  for (int page = 0; page < PW_KEYS / 16; ++page) {
    const int row = table[k0 / 16 + page] * 16;
    tma_load_3d(dst + page * 16 * 128, map, 0, kvh, row, bar);
    tma_load_3d(dst + PW_KV_SUB + page * 16 * 128, map, 64, kvh, row, bar);
  }
}
#endif

// K or V rows of one key tile (all 128 dims) into two swizzled sub-tiles, from the tile's row
// pointers (null: a row past the keys, zeroed). Producer thread p: chunk p & 15 of rows (p >> 4) + 8 i.
__device__ __forceinline__ void load_kv_tile_sw(u32 dst, const u16* const* rows, const u16* dummy, int p) {
  const int c = p & 15;
#pragma unroll
  for (int i = 0; i < PW_KEYS / 8; ++i) {
    const int kr = (p >> 4) + 8 * i;
    const u16* row = rows[kr];
    cp_async_16(dst + (c >> 3) * PW_KV_SUB + sw128(kr, c & 7), row ? row + 8 * c : dummy, row != nullptr);
  }
}

// Masks (causal, window) of a key tile at k0 for this thread's rows (positions my_q, my_q + 1).
__device__ __forceinline__ void mask_tile(float (&sc)[64], int k0, int my_q, int t, int window) {
#pragma unroll
  for (int jj = 0; jj < 16; ++jj)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int kp = k0 + 8 * jj + 2 * t + (x & 1), qp = my_q + (x >> 1);
      if (kp > qp || (window > 0 && qp - kp >= window)) sc[4 * jj + x] = NEG_INF;
    }
}

// Online softmax of one tile in place (sc becomes P, unnormalized); returns the rescale of O per row.
__device__ __forceinline__ void softmax_tile(float (&sc)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = NEG_INF;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) mx = fmaxf(mx, fmaxf(sc[4 * jj + 2 * h], sc[4 * jj + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
    const float m_new = fmaxf(m[h], mx * scale_log2);
    alpha[h] = ex2(m[h] - m_new);
    m[h] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj)
#pragma unroll
      for (int x = 2 * h; x < 2 * h + 2; ++x) {
        sc[4 * jj + x] = ex2(fmaf(sc[4 * jj + x], scale_log2, -m_new));
        sum += sc[4 * jj + x];
      }
    l[h] = l[h] * alpha[h] + sum;
  }
}

// P as bf16 A fragments: keys 16kk .. 16kk+15 = S blocks 2kk, 2kk+1.
__device__ __forceinline__ void pack_p(u32 (&pa)[8][4], const float (&sc)[64]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    pa[kk][0] = pack_bf16x2(sc[8 * kk], sc[8 * kk + 1]), pa[kk][1] = pack_bf16x2(sc[8 * kk + 2], sc[8 * kk + 3]);
    pa[kk][2] = pack_bf16x2(sc[8 * kk + 4], sc[8 * kk + 5]), pa[kk][3] = pack_bf16x2(sc[8 * kk + 6], sc[8 * kk + 7]);
  }
}

__device__ __forceinline__ void fence_p(u32 (&pa)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) wgmma_fence_frag(pa[kk]);
}

// The warp is done reading a stage: one arrival per warp (8 consumer warps per phase).
__device__ __forceinline__ void release(u32 bar, int lane) {
  __syncwarp();
  if (lane == 0) mbarrier_arrive(bar);
}

// Barriers of key tile i (stage i % PW_STAGES), from bar_q: full K, full V, empty K, empty V.
__device__ __forceinline__ u32 tile_bar(u32 bar_q, int i, int which) { return bar_q + 8 * (1 + 4 * (i % PW_STAGES) + which); }
__device__ __forceinline__ u32 tile_parity(int i) { return (i / PW_STAGES) & 1; }

// S = Q K(i)^T, issued and committed (not waited for).
__device__ __forceinline__ void issue_s(float (&sc)[64], u32 q_rows, u32 kv_smem, u32 bar_q, int i) {
  mbarrier_wait_parity(tile_bar(bar_q, i, 0), tile_parity(i));
  fence_proxy_async_shared();
#pragma unroll
  for (int x = 0; x < 64; ++x) sc[x] = 0.0f;
  wgmma_fence_acc(sc);
  wgmma_fence();
  const u32 k_tile = kv_smem + 4 * (i % PW_STAGES) * PW_KV_SUB;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)  // dims 16kk .. 16kk+15: sub-tile kk / 4, 32-byte step kk % 4
    wgmma_m64n128k16(sc, wgmma_desc(q_rows + (kk >> 2) * PW_Q_SUB + (kk & 3) * 32),
                     wgmma_desc(k_tile + (kk >> 2) * PW_KV_SUB + (kk & 3) * 32));
  wgmma_commit();
}

// O += P V(i), issued and committed.
__device__ __forceinline__ void issue_pv(float (&o)[64], u32 (&pa)[8][4], u32 kv_smem, u32 bar_q, int i) {
  mbarrier_wait_parity(tile_bar(bar_q, i, 1), tile_parity(i));
  fence_proxy_async_shared();
  wgmma_fence_acc(o);
  fence_p(pa);
  wgmma_fence();
  const u32 v_tile = kv_smem + (4 * (i % PW_STAGES) + 2) * PW_KV_SUB;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) wgmma_m64n128k16_rs_tb(o, pa[kk], wgmma_desc_mn(v_tile + kk * 16 * 128, PW_KV_SUB));
  wgmma_commit();
}

// After S(i) landed: K(i) released, masks where the tile crosses the diagonal or the window's
// lower edge, online softmax (sc becomes P, alpha the rescale of O).
__device__ __forceinline__ void finish_s(float (&sc)[64], float (&m)[2], float (&l)[2], float (&alpha)[2], u32 bar_q,
                                         int i, int n_tiles, int lo, int q_first, int q_last, int my_q, int lane,
                                         int window, float scale_log2) {
  release(tile_bar(bar_q, i, 2), lane);
  const int k0 = lo + (n_tiles - 1 - i) * PW_KEYS;
  if (k0 + PW_KEYS - 1 > q_first || (window > 0 && q_last - window + 1 > k0)) mask_tile(sc, k0, my_q, lane & 3, window);
  softmax_tile(sc, m, l, alpha, scale_log2);
}

extern "C" __global__ void __launch_bounds__(PW_THREADS, 1)
prefill_attention_wgmma_bf16(u16* out, const u16* qkv, const u16* k_pool, const u16* v_pool,
                             const int* block_tables, int table_stride, int page_rows, int window,
                             const int* entries, const int* tiles, int num_q_heads, int num_kv_heads,
                             const void* sinks, int sinks_bf16, float scale_log2
#if PW_TMA
                             , const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map
#endif
) {
  extern __shared__ __align__(128) unsigned char pw_smem[];
  // barriers: Q, then per stage full K, full V, empty K, empty V
  __shared__ __align__(8) unsigned long long pw_bars[1 + 4 * PW_STAGES];
  const int H = num_q_heads, G = num_kv_heads;
  const int kvh = blockIdx.x % G, tile = blockIdx.x / G;
  const int tid = threadIdx.x, lane = tid & 31;
  const u32 q_smem = (smem_addr(pw_smem) + 1023u) & ~1023u;
  const u32 kv_smem = q_smem + 2 * PW_Q_SUB;  // stage s: K at + 4 s PW_KV_SUB, V at + (4 s + 2) PW_KV_SUB
  const u32 bar_q = smem_addr(pw_bars);
  pdl_launch_dependents();
  pdl_wait();

  const int e = tiles[2 * tile], t0 = tiles[2 * tile + 1];
  if (e < 0) return;
  const int row0 = entries[4 * e], s = entries[4 * e + 1], n = entries[4 * e + 2];
  const int n_q = min(PF_TOKENS, n - t0);
  const int q_first = s + t0, q_last = q_first + PF_TOKENS - 1;
  const int hi = min(q_last, s + n - 1);
  const int lo = window > 0 ? max(0, q_first - window + 1) : 0;
  const int n_tiles = (hi - lo) / PW_KEYS + 1;

  __shared__ KeySource src;
  if (tid == 0) {
    src.qkv = qkv, src.k_pool = k_pool, src.v_pool = v_pool;
    src.table = block_tables ? block_tables + (long long)e * table_stride : nullptr;
    src.qkv_stride = (long long)(H + 2 * G) * HEAD_DIM, src.pool_stride = (long long)G * HEAD_DIM;
    src.ring_page = entries[4 * e + 3], src.page_rows = page_rows, src.s = s, src.row0 = row0;
    src.k_col = H * HEAD_DIM, src.v_col = (H + G) * HEAD_DIM, src.head_col = kvh * HEAD_DIM;
    mbarrier_init(bar_q, 128);
    for (int st = 0; st < PW_STAGES; ++st) {
      mbarrier_init(bar_q + 8 * (1 + 4 * st), 128);  // full: every producer thread's copies
      mbarrier_init(bar_q + 8 * (2 + 4 * st), 128);
      mbarrier_init(bar_q + 8 * (3 + 4 * st), 8);    // empty: every consumer warp
      mbarrier_init(bar_q + 8 * (4 + 4 * st), 8);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  const int role = __shfl_sync(0xFFFFFFFFu, tid >> 7, 0);  // warp-uniform for ptxas
  if (role == 0) {  // ---- producer ----
    setmaxnreg_dec<40>();
    {  // Q: tile row r = 8 * token + head; chunk tid & 15 of rows (tid >> 4) + 8 i
      const long long q_stride = (long long)(H + 2 * G) * HEAD_DIM;
      const int c = tid & 15;
#pragma unroll 4
      for (int i = 0; i < PF_ROWS / 8; ++i) {
        const int r = (tid >> 4) + 8 * i, token = r >> 3, head = r & 7;
        const u16* q_src = qkv + (long long)(row0 + t0 + token) * q_stride + (kvh * GROUP + head) * HEAD_DIM + 8 * c;
        cp_async_16(q_smem + (c >> 3) * PW_Q_SUB + sw128(r, c & 7), token < n_q ? q_src : qkv, token < n_q);
      }
      cp_async_arrive_noinc(bar_q);
    }
    // Each key row's K and V address, once per tile (a block-table lookup per row), then the copies.
    __shared__ const u16* kv_rows[2][PW_KEYS];
    for (int i = 0; i < n_tiles; ++i) {
      const int st = i % PW_STAGES, phase = (i / PW_STAGES) & 1, k0 = lo + (n_tiles - 1 - i) * PW_KEYS;
      const u32 bars = bar_q + 8 * (1 + 4 * st), k_dst = kv_smem + 4 * st * PW_KV_SUB;
#if PW_TMA
      if (block_tables && k0 + PW_KEYS - 1 <= hi) {  // a whole tile of pages (full layers: k0 % 128 == 0)
        if (i >= PW_STAGES) mbarrier_wait_parity(bars + 16, phase ^ 1);
        load_kv_tile_tma(k_dst, k_map, src.table, k0, kvh, bars, tid);
        if (i >= PW_STAGES) mbarrier_wait_parity(bars + 24, phase ^ 1);
        load_kv_tile_tma(k_dst + 2 * PW_KV_SUB, v_map, src.table, k0, kvh, bars + 8, tid);
        continue;
      }
#endif
      if (i > 0) named_bar_sync(3, 128);  // every producer thread is done with the last tile's rows
      const int kp = k0 + tid;
      kv_rows[0][tid] = kp <= hi ? src.row(kp, false) : nullptr;
      kv_rows[1][tid] = kp <= hi ? src.row(kp, true) : nullptr;
      named_bar_sync(3, 128);
      if (i >= PW_STAGES) mbarrier_wait_parity(bars + 16, phase ^ 1);
      load_kv_tile_sw(k_dst, kv_rows[0], qkv, tid);
      cp_async_arrive_noinc(bars);
      if (i >= PW_STAGES) mbarrier_wait_parity(bars + 24, phase ^ 1);
      load_kv_tile_sw(k_dst + 2 * PW_KV_SUB, kv_rows[1], qkv, tid);
      cp_async_arrive_noinc(bars + 8);
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<232>();
  const int wg = role - 1, q4 = (tid >> 5) & 3, t = lane & 3, gr = lane >> 2;
  const float sink2 = (sinks_bf16 ? bf16_to_f32(static_cast<const u16*>(sinks)[kvh * GROUP + gr])
                                  : static_cast<const float*>(sinks)[kvh * GROUP + gr]) * 1.4426950408889634f;
  float m[2], l[2], alpha[2], o[64], sc[64];
  u32 pa[8][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) m[h] = sink2, l[h] = t == 0 ? 1.0f : 0.0f;  // quad sums l at the end
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  const int my_q = q_first + 8 * wg + 2 * q4;  // position of this thread's half-0 token (half 1: + 1)
  const u32 q_rows = q_smem + wg * 64 * 128;   // this warpgroup's 64 rows in each Q sub-tile
  if (wg == 1) named_bar_arrive(1, 256);      // warpgroup 0 issues first
  mbarrier_wait_parity(bar_q, 0);
  fence_proxy_async_shared();

  // Slot i issues S(i) (i < n_tiles) and P(i-1) V(i-1) (i > 0), then runs softmax(S(i)) under them.
  // The first and the last slot are peeled: every wgmma sits on a path all warps take (ptxas
  // serializes wgmmas issued under a condition it cannot prove uniform).
  {  // slot 0
    named_bar_sync(1 + wg, 256);
    issue_s(sc, q_rows, kv_smem, bar_q, 0);
    named_bar_arrive(2 - wg, 256);
    wgmma_wait<0>();
    wgmma_fence_acc(sc);
    finish_s(sc, m, l, alpha, bar_q, 0, n_tiles, lo, q_first, q_last, my_q, lane, window, scale_log2);
    pack_p(pa, sc);
  }
  for (int i = 1; i < n_tiles; ++i) {
    named_bar_sync(1 + wg, 256);
    issue_s(sc, q_rows, kv_smem, bar_q, i);
    issue_pv(o, pa, kv_smem, bar_q, i - 1);
    named_bar_arrive(2 - wg, 256);
    wgmma_wait<1>();
    wgmma_fence_acc(sc);
    finish_s(sc, m, l, alpha, bar_q, i, n_tiles, lo, q_first, q_last, my_q, lane, window, scale_log2);
    wgmma_wait<0>();
    wgmma_fence_acc(o);
    fence_p(pa);
    release(bar_q + 8 * (4 + 4 * ((i - 1) % PW_STAGES)), lane);  // V(i-1) read
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {  // O's n8 blocks: dims 8jj .. 8jj+7
      o[4 * jj] *= alpha[0], o[4 * jj + 1] *= alpha[0];
      o[4 * jj + 2] *= alpha[1], o[4 * jj + 3] *= alpha[1];
    }
    pack_p(pa, sc);
  }
  {  // slot n_tiles: the last P V
    named_bar_sync(1 + wg, 256);
    issue_pv(o, pa, kv_smem, bar_q, n_tiles - 1);
    if (wg == 0) named_bar_arrive(2, 256);
    wgmma_wait<0>();
    wgmma_fence_acc(o);
    fence_p(pa);
  }

  // out = o / l: thread rows (tokens 8wg + 2q4 + h, head g), dims 8jj + 2t (+1), 4-byte stores.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 1);
    l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 2);
    const int token = 8 * wg + 2 * q4 + h;
    if (token >= n_q) continue;
    const float inv = 1.0f / l[h];
    u16* orow = out + (long long)(row0 + t0 + token) * H * HEAD_DIM + (kvh * GROUP + gr) * HEAD_DIM;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj)
      *reinterpret_cast<u32*>(orow + 8 * jj + 2 * t) = pack_bf16x2(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
  }
}
