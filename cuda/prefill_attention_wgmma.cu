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
// KV_FP8 (e4m3 pools): the producer loads the pool / ring rows itself and stores them converted to
// bf16 where cp.async would have (load_kv_tile_e4m3), so the consumers are unchanged; no TMA.
// Thread (consumer warpgroup w, warp q, lane 4g + t): rows 16q + g and + 8 of the warpgroup's 64 =
// tokens 8w + 2q + {0, 1}, head g; columns 8j + 2t (+ 1) (the accumulator layout in wgmma.cuh).
#include "prefill_attention.cuh"
#include "wgmma.cuh"

#define PW_THREADS 384
#define PW_KEYS 128
#define PW_STAGES 2
#define PW_Q_SUB (PF_ROWS * 128)   // 16 KB: 128 rows x 64 dims
#define PW_KV_SUB (PW_KEYS * 128)  // 16 KB: 128 keys x 64 dims
// Q (2 sub-tiles), then per stage K (2) and V (2), each 1024-byte aligned; the launcher adds 1 KB.
static_assert(2 * PW_Q_SUB + PW_STAGES * 4 * PW_KV_SUB == 163840, "kernels/prefill_attention.py WGMMA_SMEM_BYTES");

#ifndef PW_TMA
#define PW_TMA 0
#endif
#if PW_TMA && KV_FP8
#error "TMA copies bf16 pages as they are: FP8 pools take the cp.async path (kernels/prefill_attention.py)"
#endif
#if KV_FP8
// Each producer thread arrives on a full barrier twice: after its e4m3 rows (stores) and for its cp.async.
#define PW_FULL_ARRIVALS 256
#else
#define PW_FULL_ARRIVALS 128
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
    cp_async_16(dst + (c >> 3) * PW_KV_SUB + sw128(kr, c & 7), row ? row + 8 * c : dummy, row ? 16u : 0u);
  }
}

#if KV_FP8
// load_kv_tile_sw for e4m3 pools, arriving on `full` itself: rows before `fresh_from` (the pool or
// ring) are loaded 8 bytes a chunk, converted and stored as bf16 where cp.async would have put them;
// the rest (fresh, bf16; null rows zero-filled) by cp.async. The loads of 8 e4m3 rows go to registers
// first so they overlap, the first 8 before the wait for the stage to be empty (`empty` at `parity`;
// `wait` false for a stage's first fill). Two arrivals a thread (PW_FULL_ARRIVALS): a plain one after
// the converted stores, fenced to the consumers' async proxy (wgmma) first, and the cp.async one.
// NOTE: the fence only where this thread stored (e4m3 rows): it waits for the thread's cp.async
// copies still in flight too, which would serialize a tile of fresh rows (an 8K prompt's attention
// took 43 ms instead of 25 with the fence on every tile; H200).
__device__ __forceinline__ void load_kv_tile_e4m3(u32 dst, const kv_t* const* rows, const u16* dummy, int fresh_from,
                                                  int p, u32 full, u32 empty, u32 parity, bool wait) {
  const int c = p & 15;
  bool stored = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint2 raw[PW_KEYS / 16];
#pragma unroll
    for (int i = 0; i < PW_KEYS / 16; ++i) {
      const int kr = (p >> 4) + 8 * (PW_KEYS / 16 * half + i);
      const kv_t* row = rows[kr];
      raw[i] = row && kr < fresh_from ? ld_e4m3x8(row + 8 * c) : make_uint2(0, 0);
    }
    if (half == 0 && wait) mbarrier_wait_parity(empty, parity);
#pragma unroll
    for (int i = 0; i < PW_KEYS / 16; ++i) {
      const int kr = (p >> 4) + 8 * (PW_KEYS / 16 * half + i);
      if (rows[kr] && kr < fresh_from) {
        st_shared_bf16x8_from_e4m3(dst + (c >> 3) * PW_KV_SUB + sw128(kr, c & 7), raw[i]);
        stored = true;
      }
    }
  }
  if (stored) fence_proxy_async_shared();
  mbarrier_arrive(full);
#pragma unroll
  for (int i = 0; i < PW_KEYS / 8; ++i) {
    const int kr = (p >> 4) + 8 * i;
    const kv_t* row = rows[kr];
    if (!row || kr >= fresh_from)
      cp_async_16(dst + (c >> 3) * PW_KV_SUB + sw128(kr, c & 7), row ? static_cast<const void*>(row + 16 * c) : dummy,
                  row ? 16u : 0u);
  }
  cp_async_arrive_noinc(full);
}
#endif

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
prefill_attention_wgmma_bf16(u16* out, const u16* qkv, const kv_t* k_pool, const kv_t* v_pool,
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

  QueryTile qt;
  if (!qt.set(entries, tiles, tile, window)) return;
  const int t0 = qt.t0, row0 = qt.row0, n_q = qt.n_q, q_first = qt.q_first, q_last = qt.q_last, hi = qt.hi, lo = qt.lo;
  const int n_tiles = (hi - lo) / PW_KEYS + 1;

  __shared__ KeySource src;
  if (tid == 0) {
    src.set(qkv, k_pool, v_pool, block_tables, table_stride, entries, qt.e, page_rows, H, G, kvh);
    mbarrier_init(bar_q, 128);
    for (int st = 0; st < PW_STAGES; ++st) {
      mbarrier_init(bar_q + 8 * (1 + 4 * st), PW_FULL_ARRIVALS);  // full: every producer thread's copies
      mbarrier_init(bar_q + 8 * (2 + 4 * st), PW_FULL_ARRIVALS);
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
        cp_async_16(q_smem + (c >> 3) * PW_Q_SUB + sw128(r, c & 7), token < n_q ? q_src : qkv, token < n_q ? 16u : 0u);
      }
      cp_async_arrive_noinc(bar_q);
    }
    // Each key row's K and V address, once per tile (a block-table lookup per row), then the copies.
    __shared__ const kv_t* kv_rows[2][PW_KEYS];
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
#if KV_FP8
      const int fresh_from = src.s - k0;  // rows from here on: q/k/v (bf16; KeySource::row)
      if (fresh_from > 0) {  // e4m3 rows of the pool or ring: converted on their way in
        load_kv_tile_e4m3(k_dst, kv_rows[0], qkv, fresh_from, tid, bars, bars + 16, phase ^ 1, i >= PW_STAGES);
        load_kv_tile_e4m3(k_dst + 2 * PW_KV_SUB, kv_rows[1], qkv, fresh_from, tid, bars + 8, bars + 24, phase ^ 1,
                          i >= PW_STAGES);
        continue;
      }
      // A tile of fresh rows only (every tile of a lone prompt) takes the bf16 copies below, with the
      // e4m3 path's plain arrival too: load_kv_tile_e4m3 made an 8K prompt's full layer 2.35x slower
      // (RESULTS.md, session 20).
#endif
      const u16* const* rows = reinterpret_cast<const u16* const*>(kv_rows);  // bf16 rows (KV_FP8: fresh)
      if (i >= PW_STAGES) mbarrier_wait_parity(bars + 16, phase ^ 1);
      load_kv_tile_sw(k_dst, rows, qkv, tid);
      if (KV_FP8) mbarrier_arrive(bars);  // PW_FULL_ARRIVALS
      cp_async_arrive_noinc(bars);
      if (i >= PW_STAGES) mbarrier_wait_parity(bars + 24, phase ^ 1);
      load_kv_tile_sw(k_dst + 2 * PW_KV_SUB, rows + PW_KEYS, qkv, tid);
      if (KV_FP8) mbarrier_arrive(bars + 8);
      cp_async_arrive_noinc(bars + 8);
    }
    cp_async_wait<0>();
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
