// Prefill attention with sinks: what the two kernels share. Causal flash attention over the query
// chunks of several requests in one launch (online softmax, bf16 tensor cores, fp32 accumulators),
// GQA packed: a tile's 128 rows are 16 tokens x the 8 query heads of one KV head, so each K/V tile
// serves all 8 heads (row r of a tile = token r / 8, head r % 8).
//
//   prefill_attention.cu        prefill_attention_bf16: mma.sync, any GPU from sm_80
//   prefill_attention_wgmma.cu  prefill_attention_wgmma_bf16: warpgroup MMAs, sm_90a (the default there)
//
// Grid: one CTA per (tile, KV head), 1-D, heaviest tiles first (the host sorts `tiles`). Keys of a
// tile whose tokens sit at positions q_first .. q_first + 15 of a request whose chunk is
// [s, s + n):  full layers (window == 0): 0 .. min(q_last, s + n - 1), all read from the paged pool
// (the chunk's own K/V were written there first);  sliding layers: from max(0, q_first - window + 1),
// positions < s from the request's ring slot (history), positions >= s from the q/k/v buffer
// (fresh, normed and roped). Key tiles run from the last (the diagonal) down; masks only on tiles
// that cross the diagonal or the window's lower edge.
//
// Softmax in the log2 domain (x = s * scale * log2 e). The sink starts each row: m = sink * log2 e,
// l = 1 (a logit whose value vector is zero), so m is always finite and fully masked tiles add
// exact zeros; out = o / l.
//
// KV_FP8 (a define): the pool / ring is e4m3 (attention_common.cuh), converted to bf16 on its way
// into shared memory, so the MMAs are the bf16 path's; the chunk's own rows (fresh) come from q/k/v
// on both kinds of layers, bf16 and exact.
#pragma once
#include "attention_common.cuh"

#define PF_TOKENS 16                   // query tokens per tile (flint_sched/kernels/prefill_attention.py)
#define PF_ROWS (PF_TOKENS * GROUP)    // 128 (token, head) rows

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#if KV_FP8
// 8 e4m3 values of a pool row (8-byte aligned) through L2, as cp.async.cg reads a bf16 row.
__device__ __forceinline__ uint2 ld_e4m3x8(const kv_t* p) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// Those 8 values as 8 bf16 (exact) into 16 bytes of shared memory.
__device__ __forceinline__ void st_shared_bf16x8_from_e4m3(u32 dst, uint2 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(bf16x2_from_e4m3x2(v.x)),
               "r"(bf16x2_from_e4m3x2(v.x >> 16)), "r"(bf16x2_from_e4m3x2(v.y)), "r"(bf16x2_from_e4m3x2(v.y >> 16))
               : "memory");
}
#endif

// Where the keys of one request live, for one KV head (see the header).
struct KeySource {
  const u16* qkv;       // the step's q/k/v rows, (H + 2G) * 128 per token
  const kv_t* k_pool;   // paged pool or ring of this layer
  const kv_t* v_pool;
  const int* table;     // this request's block table row (full layers), else null
  long long qkv_stride, pool_stride;  // elements per token row
  int ring_page, page_rows, s, row0, k_col, v_col, head_col;

  // Key (or value) row of position kp for this KV head: paged pool, ring (history) or q/k/v (fresh).
  // NOTE: with KV_FP8 a pool or ring row is e4m3 and a fresh row bf16 (fresh(kp)), both as kv_t*.
  // With KV_FP8 full layers read the chunk's own rows from q/k/v too (bf16, no conversion: a lone
  // prompt reads no e4m3 at all), so on both kinds of layers the history is e4m3, the chunk exact.
  __device__ __forceinline__ const kv_t* row(int kp, bool v) const {
    if (table && (!KV_FP8 || kp < s)) {
      const long long r = (long long)table[kp / page_rows] * page_rows + kp % page_rows;
      return (v ? v_pool : k_pool) + r * pool_stride + head_col;
    }
    if (kp < s) {
      const long long r = (long long)ring_page * page_rows + kp % page_rows;
      return (v ? v_pool : k_pool) + r * pool_stride + head_col;
    }
    return reinterpret_cast<const kv_t*>(qkv + (long long)(row0 + kp - s) * qkv_stride + (v ? v_col : k_col) +
                                         head_col);
  }
  __device__ __forceinline__ bool fresh(int kp) const { return kp >= s && (!table || KV_FP8); }

  // Entry e's sources for KV head kvh (block_tables null: a sliding layer).
  __device__ __forceinline__ void set(const u16* qkv_, const kv_t* k_pool_, const kv_t* v_pool_,
                                      const int* block_tables, int table_stride, const int* entries, int e,
                                      int page_rows_, int H, int G, int kvh) {
    qkv = qkv_, k_pool = k_pool_, v_pool = v_pool_;
    table = block_tables ? block_tables + (long long)e * table_stride : nullptr;
    qkv_stride = (long long)(H + 2 * G) * HEAD_DIM, pool_stride = (long long)G * HEAD_DIM;
    ring_page = entries[4 * e + 3], page_rows = page_rows_, s = entries[4 * e + 1], row0 = entries[4 * e];
    k_col = H * HEAD_DIM, v_col = (H + G) * HEAD_DIM, head_col = kvh * HEAD_DIM;
  }
};

// The query tile of one CTA (see the header): its entry, first token, and the keys it attends to.
struct QueryTile {
  int e, t0, row0, s, n;
  int n_q;                // real tokens in the tile
  int q_first, q_last;    // positions of its first and last token (padded tokens keep their would-be positions)
  int hi, lo;             // its keys: lo .. hi

  // False for a padding tile of a captured prompt step (kernels/prefill_attention.py PrefillBuffers).
  __device__ __forceinline__ bool set(const int* entries, const int* tiles, int tile, int window) {
    e = tiles[2 * tile], t0 = tiles[2 * tile + 1];
    if (e < 0) return false;
    row0 = entries[4 * e], s = entries[4 * e + 1], n = entries[4 * e + 2];
    n_q = min(PF_TOKENS, n - t0);
    q_first = s + t0, q_last = q_first + PF_TOKENS - 1;
    hi = min(q_last, s + n - 1);
    lo = window > 0 ? max(0, q_first - window + 1) : 0;
    return true;
  }
};
