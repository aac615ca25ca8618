// prefill_attention_bf16: prefill attention with sinks on mma.sync (any GPU from sm_80); what the
// tiles, keys and softmax are: prefill_attention.cuh. On sm_90a prefill_attention_wgmma.cu runs
// instead.
//
//   warp w owns rows 32w .. 32w+31 = tokens 4w .. 4w+3
//   lane (g = lane / 4, t = lane % 4) holds rows of head g, tokens 4w + {0, 1, 2, 3}
//
// Key tiles of 64. Pipeline (FlashAttention-2's): single K and V buffers; V(j) loads under Q.K(j)
// and the softmax, K(j-1) under P.V(j). Two CTAs per SM overlap each other's waits.
#include "prefill_attention.cuh"

#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define PF_KEYS 64                     // keys per K/V tile

// NOTE: rows sit 272 B apart in shared memory (256 + 16 pad): the 8 row addresses of every
// ldmatrix fall in 8 distinct 16-byte bank groups (decode_attention.cu does the same).
constexpr int SROW = HEAD_DIM * 2 + 16;
constexpr int Q_SMEM = PF_ROWS * SROW;   // 34,816 B
constexpr int KV_SMEM = PF_KEYS * SROW;  // 17,408 B each for K and V
static_assert(Q_SMEM + 2 * KV_SMEM == 69632, "kernels/prefill_attention.py SMEM_BYTES");

__device__ __forceinline__ u32 srow(int row, int chunk) { return row * SROW + (chunk << 4); }

// K or V rows k0 .. k0+63 into shared memory (rows past `hi` zeroed: finite, so masked P = 0
// times them stays 0). Thread: chunk tid % 16 of rows tid / 16 + 8i.
// KV_FP8: an e4m3 row's chunk is 8 bytes, loaded (all the thread's rows first, so the loads overlap)
// and stored as bf16 where cp.async would have put it; the __syncthreads before a tile is read
// makes these stores visible as it does the cp.async. Fresh rows (bf16) keep cp.async.
__device__ __forceinline__ void load_kv_tile(u32 dst, const KeySource& src, bool v, int k0, int hi, int tid) {
  const int c = tid & 15;
#if KV_FP8
  uint2 raw[PF_KEYS / 8];
#pragma unroll
  for (int i = 0; i < PF_KEYS / 8; ++i) {
    const int kp = k0 + (tid >> 4) + 8 * i;
    raw[i] = kp <= hi && !src.fresh(kp) ? ld_e4m3x8(src.row(kp, v) + 8 * c) : make_uint2(0, 0);
  }
#pragma unroll
  for (int i = 0; i < PF_KEYS / 8; ++i) {
    const int kr = (tid >> 4) + 8 * i, kp = k0 + kr;
    if (kp <= hi && src.fresh(kp)) cp_async_16(dst + srow(kr, c), src.row(kp, v) + 16 * c, 16u);
    else st_shared_bf16x8_from_e4m3(dst + srow(kr, c), raw[i]);
  }
#else
#pragma unroll
  for (int i = 0; i < PF_KEYS / 8; ++i) {
    const int kr = (tid >> 4) + 8 * i, kp = k0 + kr;
    const bool valid = kp <= hi;
    cp_async_16(dst + srow(kr, c), valid ? src.row(kp, v) + 8 * c : src.qkv, valid ? 16u : 0u);
  }
#endif
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2)
prefill_attention_bf16(u16* out, const u16* qkv, const kv_t* k_pool, const kv_t* v_pool, const int* block_tables,
                       int table_stride, int page_rows, int window, const int* entries, const int* tiles,
                       int num_q_heads, int num_kv_heads, const void* sinks, int sinks_bf16, float scale_log2) {
  extern __shared__ uint4 smem[];
  const int H = num_q_heads, G = num_kv_heads;
  const int kvh = blockIdx.x % G, tile = blockIdx.x / G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, gr = lane >> 2;
  const u32 q_smem = smem_addr(smem), k_smem = q_smem + Q_SMEM, v_smem = k_smem + KV_SMEM;
  pdl_launch_dependents();
  pdl_wait();  // q/k/v and the pool rows of this chunk come from the kernel before

  QueryTile qt;
  if (!qt.set(entries, tiles, tile, window)) return;
  const int t0 = qt.t0, row0 = qt.row0, n_q = qt.n_q, q_first = qt.q_first, q_last = qt.q_last, hi = qt.hi, lo = qt.lo;
  const int n_tiles = (hi - lo) / PF_KEYS + 1;

  // NOTE: kept in shared memory and read when a tile is issued: in registers it spilled (255 used).
  __shared__ KeySource src;
  if (tid == 0) {
    src.set(qkv, k_pool, v_pool, block_tables, table_stride, entries, qt.e, page_rows, H, G, kvh);
  }
  __syncthreads();

  // Q: thread loads head tid / 16 (of the group), chunk tid % 16, of all 16 tokens (rows 8i + head).
  {
    const int hh = tid >> 4, c = tid & 15;
    const long long q_stride = (long long)(H + 2 * G) * HEAD_DIM;
    const u16* q_src = qkv + (long long)(row0 + t0) * q_stride + (kvh * GROUP + hh) * HEAD_DIM + 8 * c;
#pragma unroll
    for (int i = 0; i < PF_TOKENS; ++i)
      cp_async_16(q_smem + srow(8 * i + hh, c), i < n_q ? q_src + i * q_stride : qkv, i < n_q ? 16u : 0u);
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
    cp_async_wait<0>();
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

    cp_async_wait<0>();
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
