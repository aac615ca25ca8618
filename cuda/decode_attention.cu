// Split-KV decode attention with sinks: one new query per request, 8 query heads per KV head.
// Grid (S splits, G kv heads, B requests), 4 warps: each CTA reads its key range of one KV head
// once and serves all 8 query heads of the group with mma.sync (the heads are rows 0-7 of the
// 16-row A operand; rows 8-15 are zero). Request b's query heads start q_stride elements after b-1's
// (H * 128 for a [B, H, 128] q; a prompt step's decode rows read theirs from q/k/v rows in place).
// Visible keys of request b, L = seq_lens[b]:
//   full (window == 0): 0 .. L-1          sliding: max(0, L-window) .. L-1
// The host picks S from an upper bound on L; the key range is cut on the device from the real L:
//   n = #visible   chunk = max(MIN_SPLIT_KEYS, roundup(ceil(n / S), 16))   active = ceil(n / chunk)
//   |--- split 0 ---|--- split 1 ---| ... |- split active-1 -|   splits >= active exit at once
// so one CUDA graph serves every L up to the bound. A grid of several waves (attention.py
// one_split_below) gives requests of n < one_split_below keys one split: chunk = n. Warps stream
// 16-key tiles (warp w: tiles w, w+4, ...) through their own 2-stage ring of bulk copies (e4m3:
// cp.async, load_tile). Active splits write (m, l, o) partials merged by ticket-elected last CTAs (a
// two-level tree, below), which add the sink once; tickets reset themselves for graph replay.
// Softmax runs in the log2 domain (x = s * scale * log2 e).
//
// KV_FP8 (an e4m3 cache, attention_common.cuh): the tiles hold 128-byte rows and the MMAs take f16
// (e4m3 -> f16x2 is one instruction a pair). The dims of a key are summed in another order so that
// each ldmatrix word (4 e4m3 of one key) feeds one k-step: lane t's k pairs (2t, 2t+1 | 2t+8, 2t+9)
// of a 16-dim block are dims 4t..4t+3, so Q is loaded in that order too. For P.V one transposed
// word holds dims 2g, 2g+1 of keys 2t, 2t+1: a byte permute splits it into an even-dim and an
// odd-dim n-tile (tile 2c + e: dims 16c + 2n + e), put back in order when the warps combine.
#include "attention_common.cuh"

#ifndef ATTN_WARPS
#define ATTN_WARPS 4
#endif
#ifndef ATTN_STAGES
#define ATTN_STAGES 2
#endif
// 1: the tiles' rows come by cp.async (16 bytes a lane, whole rows per warp instruction) instead of
// one bulk copy a row (kernels/attention.py CP_ASYNC_DTYPES)
#ifndef ATTN_CP_ASYNC
#define ATTN_CP_ASYNC 0
#endif
#define ATTN_THREADS (ATTN_WARPS * 32)
// The barrier of the CTA's attention threads: all of them, or (cuda/decode_step.cu) a named barrier
// of the first ATTN_THREADS threads of a larger CTA.
#ifndef ATTN_SYNC
#define ATTN_SYNC() __syncthreads()
#endif
#define ATTN_TILE 16            // keys per warp step
#ifndef ATTN_MIN_SPLIT_KEYS
#define ATTN_MIN_SPLIT_KEYS 64  // flint_sched/kernels/attention.py MIN_SPLIT_KEYS (passed as a define)
#endif
#define PARTIAL_FLOATS (GROUP * HEAD_DIM + 2 * GROUP)  // o[8][128], m[8], l[8]
#define MERGE_GROUP 16                                 // splits per first-level merge
#define MAX_GROUPS 8                                   // 128 splits at most (attention.py MAX_SPLITS)
#define TICKETS_PER_LAUNCH 8192                        // final tickets, one per (request, kv head)
#define COMBINE_STRIDE (HEAD_DIM + 8)                  // padded o rows: conflict-free float2 stores

constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(kv_t);    // one key (or value) row of one head
// NOTE: rows sit 272 B apart in shared memory (256 + 16 pad; FP8 144): bulk copies cannot swizzle, and
// with the pad the 8 row addresses of every ldmatrix fall in 8 distinct 16-byte bank groups.
constexpr int SMEM_ROW_BYTES = ROW_BYTES + 16;
constexpr int TILE_BYTES = ATTN_TILE * SMEM_ROW_BYTES;     // K (or V) of one tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;                // K then V
constexpr int WARP_SMEM_BYTES = ATTN_STAGES * STAGE_BYTES;
static_assert(WARP_SMEM_BYTES >= (2 * GROUP + GROUP * COMBINE_STRIDE) * 4, "combine area must fit");
static_assert(ATTN_THREADS == GROUP * HEAD_DIM / 8, "the epilogue maps one thread to (head, 8 dims)");

__device__ __forceinline__ u32 tile_offset(int key, int chunk) { return key * SMEM_ROW_BYTES + (chunk << 4); }

struct SplitState {
  float m;        // running max of head g (lane / 4), log2 domain, same in the 4 lanes of a row
  float l;        // this lane's share of the running sum
  float o[16][4]; // o[n][0..1] = O[g][8n + 2t .. +1] (KV_FP8: the dims of attend_tile); [2..3] rows 8-15: zero
};

// One tile of 16 keys at `first_pos` (keys >= end masked) from shared memory into the state.
__device__ __forceinline__ void attend_tile(SplitState& st, const u32 (&qa)[8][2], u32 k_base, u32 v_base,
                                            int first_pos, int end, float scale_log2, int lane) {
  const int t = lane & 3, mi = lane >> 3, r8 = lane & 7;
  // S[g][key] for keys 8j..8j+7 (n-tile j): B operand = K rows, ldmatrix (non-trans) over dims.
  float s[2][4] = {};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#if KV_FP8
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {  // 64 dims per ldmatrix.x4: k-steps 4c2 .. 4c2+3
      u32 kb[4];
      ldmatrix_x4(kb, k_base + tile_offset(8 * j + r8, 4 * c2 + mi));
#pragma unroll
      for (int i = 0; i < 4; ++i)
        mma_f16_16x8x16(s[j], qa[4 * c2 + i][0], 0u, qa[4 * c2 + i][1], 0u, f16x2_from_e4m3x2(kb[i]),
                        f16x2_from_e4m3x2_hi(kb[i]));
    }
#else
#pragma unroll
    for (int c2 = 0; c2 < 4; ++c2) {  // 32 dims per ldmatrix.x4: k-steps 2c2 and 2c2+1
      u32 kb[4];
      ldmatrix_x4(kb, k_base + tile_offset(8 * j + r8, 4 * c2 + mi));
      mma_bf16_16x8x16(s[j], qa[2 * c2][0], 0u, qa[2 * c2][1], 0u, kb[0], kb[1]);
      mma_bf16_16x8x16(s[j], qa[2 * c2 + 1][0], 0u, qa[2 * c2 + 1][1], 0u, kb[2], kb[3]);
    }
#endif
  }
  // Online softmax over the row of head g: this lane holds keys 8j + 2t + e.
  float x[2][2], tile_max = NEG_INF;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool valid = first_pos + 8 * j + 2 * t + e < end;
      x[j][e] = valid ? s[j][e] * scale_log2 : NEG_INF;
      tile_max = fmaxf(tile_max, x[j][e]);
    }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, 2));
  const float m_new = fmaxf(st.m, tile_max);  // finite: every tile has a valid key
  const float alpha = exp2f(st.m - m_new);    // 0 on the first tile (m = -inf)
  float p[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) p[j][e] = exp2f(x[j][e] - m_new);
  st.l = st.l * alpha + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
  st.m = m_new;
  // P as the A operand (rows = heads, k = keys 2t, 2t+1 | 2t+8, 2t+9): exactly the S fragments.
#if KV_FP8
  const u32 pa0 = pack_f16x2(p[0][0], p[0][1]), pa2 = pack_f16x2(p[1][0], p[1][1]);
  // O[g][dims] += P . V: V words through ldmatrix.trans, 32 dims (chunks 2n2, 2n2 + 1) per x4:
  // vb[2h] keys 0-7 and vb[2h+1] keys 8-15 of chunk 2n2 + h, each split into its even and odd dims.
#pragma unroll
  for (int n2 = 0; n2 < 4; ++n2) {
    u32 vb[4];
    ldmatrix_x4_trans(vb, v_base + tile_offset(r8 + 8 * (mi & 1), 2 * n2 + (mi >> 1)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 lo = prmt(vb[2 * h], 0u, 0x3120u), hi = prmt(vb[2 * h + 1], 0u, 0x3120u);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float(&o)[4] = st.o[2 * (2 * n2 + h) + e];
        o[0] *= alpha;
        o[1] *= alpha;
        mma_f16_16x8x16(o, pa0, 0u, pa2, 0u, e ? f16x2_from_e4m3x2_hi(lo) : f16x2_from_e4m3x2(lo),
                        e ? f16x2_from_e4m3x2_hi(hi) : f16x2_from_e4m3x2(hi));
      }
    }
  }
#else
  const u32 pa0 = pack_bf16x2(p[0][0], p[0][1]), pa2 = pack_bf16x2(p[1][0], p[1][1]);
  // O[g][dims] += P . V: B operand = V (k = keys, n = dims) through ldmatrix.trans.
#pragma unroll
  for (int n2 = 0; n2 < 8; ++n2) {  // 16 dims per ldmatrix.x4.trans: n-tiles 2n2 and 2n2+1
    u32 vb[4];
    ldmatrix_x4_trans(vb, v_base + tile_offset(r8 + 8 * (mi & 1), 2 * n2 + (mi >> 1)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float(&o)[4] = st.o[2 * n2 + h];
      o[0] *= alpha;
      o[1] *= alpha;
      mma_bf16_16x8x16(o, pa0, 0u, pa2, 0u, vb[2 * h], vb[2 * h + 1]);
    }
  }
#endif
}

// Starts one tile (K and V of 16 keys, `valid_keys` of them before the split's end) into a pipeline
// stage. `my_row`: this lane's key (lane % 16) as the element offset of its row in the pool, -1 at or
// past the end: such keys are zeroed instead (finite zeros: 0 * NaN would poison P.V).
//   bulk copies: lanes 0-15 copy K rows, lanes 16-31 V rows, one row each, completing on the
//     stage's mbarrier by bytes (one arrival)
//   ATTN_CP_ASYNC: lane k < 16 holds key k's row; each warp instruction then moves 512 bytes,
//     whole rows (16-byte chunk lane % CHUNKS of row lane / CHUNKS), and every lane arrives on the
//     mbarrier when its copies land (32 arrivals)
__device__ __forceinline__ void load_tile(u32 stage, u32 bar, const kv_t* k_cache, const kv_t* v_cache,
                                          long long my_row, long long head_offset, int valid_keys, int lane) {
#if ATTN_CP_ASYNC
  constexpr int CHUNKS = ROW_BYTES / 16, ROWS_PER_COPY = 32 / CHUNKS;
  const int c = lane % CHUNKS;
#pragma unroll
  for (int i = 0; i < ATTN_TILE / ROWS_PER_COPY; ++i) {
    const int k = i * ROWS_PER_COPY + lane / CHUNKS;
    const long long row = __shfl_sync(0xFFFFFFFFu, my_row, k);
    const long long elem = row < 0 ? head_offset : row + c * (16 / (int)sizeof(kv_t));
    const u32 dst = stage + k * SMEM_ROW_BYTES + 16 * c, bytes = row < 0 ? 0u : 16u;
    cp_async_16(dst, k_cache + elem, bytes);
    cp_async_16(dst + TILE_BYTES, v_cache + elem, bytes);
  }
  cp_async_arrive_noinc(bar);
#else
  const u32 dst = stage + (lane >> 4) * TILE_BYTES + (lane & 15) * SMEM_ROW_BYTES;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, 2 * valid_keys * ROW_BYTES);
  __syncwarp();
  if (my_row >= 0) {
    const kv_t* src = (lane < 16 ? k_cache : v_cache) + my_row;
    fence_proxy_async_shared();
    bulk_copy_g2s(dst, src, ROW_BYTES, bar);
  } else {
#pragma unroll
    for (int c = 0; c < ROW_BYTES / 16; ++c)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst + 16 * c), "r"(0u) : "memory");
  }
#endif
}

// This lane's key (lane % 16) of the warp's next tile in the loop: position, (page, row in the
// page) and the page's pool page. The warp's tiles step ATTN_WARPS * 16 keys, so the row moves on by
// subtractions rather than a division by the run-time page_rows, and the block table entry of the
// next tile is read one tile ahead: its load is not on the warp's way from one tile to the next.
struct KeyCursor {
  int pos, page, offset;  // p, p / page_rows, p % page_rows (a ring's page is unused: its rows wrap)
  long long page_base;    // block_tables[b][page] (0 past the end: nothing read), or the ring's slot

  __device__ __forceinline__ KeyCursor(int p, const KvPages& pages, int end)
      : pos(p), page(p / pages.page_rows), offset(p % pages.page_rows) {
    fetch(pages, end);
  }

  __device__ __forceinline__ void fetch(const KvPages& pages, int end) {
    page_base = !pages.table ? pages.ring_page : pos < end ? (long long)pages.table[page] : 0ll;
  }

  // Element offset of the key's row in the pool (KvPages::row times the row's elements), -1 past the end.
  __device__ __forceinline__ long long row(const KvPages& pages, int end, int kv_row_elems,
                                           long long head_offset) const {
    return pos < end ? (page_base * pages.page_rows + offset) * kv_row_elems + head_offset : -1ll;
  }

  __device__ __forceinline__ void advance(int keys, const KvPages& pages, int end) {
    pos += keys;
    offset += keys;
    while (offset >= pages.page_rows) offset -= pages.page_rows, ++page;
    fetch(pages, end);
  }
};

__device__ __forceinline__ float load_sink(const void* sinks, int sinks_bf16, int h) {
  return sinks_bf16 ? bf16_to_f32(static_cast<const u16*>(sinks)[h]) : static_cast<const float*>(sinks)[h];
}

// out[h] = o / (l + 2^(sink - m)) after lifting m to max(m, sink): the sink joins the max and the
// denominator once, never the numerator.
__device__ __forceinline__ void store_final(u16* out, const float (&o)[8], float m, float l, float sink2) {
  const float top = fmaxf(m, sink2);
  const float scale = m == NEG_INF ? 0.0f : exp2f(m - top);
  const float denom = l * scale + exp2f(sink2 - top);
  const float f = scale / denom;
  *reinterpret_cast<uint4*>(out) = make_uint4(pack_bf16x2(o[0] * f, o[1] * f), pack_bf16x2(o[2] * f, o[3] * f),
                                              pack_bf16x2(o[4] * f, o[5] * f), pack_bf16x2(o[6] * f, o[7] * f));
}

// (m, l, o) <- (m, l, o) (+) (m_s, l_s, o_s): online-softmax union, log2 domain. An empty side
// (m = -inf) contributes nothing, so two empty sides stay empty instead of turning into NaN.
__device__ __forceinline__ void merge_into(float& m, float& l, float (&o)[8], float m_s, float l_s, float4 lo,
                                           float4 hi) {
  const float top = fmaxf(m, m_s);
  const float a = m == NEG_INF ? 0.0f : exp2f(m - top);
  const float f = m_s == NEG_INF ? 0.0f : exp2f(m_s - top);
  m = top;
  l = l * a + f * l_s;
  o[0] = o[0] * a + f * lo.x, o[1] = o[1] * a + f * lo.y, o[2] = o[2] * a + f * lo.z, o[3] = o[3] * a + f * lo.w;
  o[4] = o[4] * a + f * hi.x, o[5] = o[5] * a + f * hi.y, o[6] = o[6] * a + f * hi.z, o[7] = o[7] * a + f * hi.w;
}

// Partial slot: o[8][128] unnormalized, then m[8], l[8]. Written by other CTAs: read from L2.
__device__ __forceinline__ void store_partial(float* part, int h, int d, float m, float l, const float (&o)[8]) {
  *reinterpret_cast<float4*>(part + h * HEAD_DIM + d) = make_float4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<float4*>(part + h * HEAD_DIM + d + 4) = make_float4(o[4], o[5], o[6], o[7]);
  if (d == 0) part[GROUP * HEAD_DIM + h] = m, part[GROUP * HEAD_DIM + GROUP + h] = l;
}

__device__ __forceinline__ void merge_partials_strided(const float* first, int count, int stride_slots, int h, int d,
                                                       float& m, float& l, float (&o)[8]) {
#pragma unroll 8
  for (int s = 0; s < count; ++s) {
    const float* part = first + (long long)s * stride_slots * PARTIAL_FLOATS;
    merge_into(m, l, o, ld_cg_f32(part + GROUP * HEAD_DIM + h), ld_cg_f32(part + GROUP * HEAD_DIM + GROUP + h),
               ld_cg_f32x4(part + h * HEAD_DIM + d), ld_cg_f32x4(part + h * HEAD_DIM + d + 4));
  }
}

__device__ __forceinline__ void merge_partials(const float* first, int count, int h, int d, float& m, float& l,
                                               float (&o)[8]) {
  merge_partials_strided(first, count, 1, h, d, m, l, o);
}

// Counts this CTA in after its partial is written; true for the `arrivals`-th (last) CTA, which
// also resets the ticket for the next launch. One thread fences after the barrier (fences are
// cumulative, as in cooperative groups' grid sync); the last fences again before reading.
__device__ __forceinline__ bool take_ticket(u32* ticket, int arrivals, int* flag) {
  ATTN_SYNC();
  if (threadIdx.x == 0) {
    const bool last = ticket_arrive(ticket) == (u32)(arrivals - 1);
    if (last) {
      *ticket = 0u;
      ticket_acquire();
    }
    *flag = last;
  }
  ATTN_SYNC();
  return *flag;
}

// Keys a split of n_keys visible keys takes (the last active split ends at the newest key).
__device__ __forceinline__ int split_chunk(int n_keys, int num_splits, int one_split_below) {
  const int chunk = max(ATTN_MIN_SPLIT_KEYS, cdiv_i(cdiv_i(n_keys, num_splits), ATTN_TILE) * ATTN_TILE);
  return n_keys < one_split_below ? max(chunk, n_keys) : chunk;  // one split: active = 1
}

// One CTA (threads 0 .. ATTN_THREADS - 1): split `split` of `num_splits` of KV head g (of G) of request b.
__device__ __forceinline__ void decode_attention_cta(int split, int g, int b, int num_splits, int G, u16* out,
                                                     const u16* q, int q_stride, const kv_t* k_cache,
                                                     const kv_t* v_cache, const int* block_tables, int table_stride,
                                                     const int* ring_slots, int page_rows, int window,
                                                     const int* seq_lens, int one_split_below, const void* sinks,
                                                     int sinks_bf16, float scale_log2, u32* tickets, float* partials) {
  extern __shared__ uint4 attn_smem[];
  __shared__ u64 stage_bars[ATTN_WARPS][ATTN_STAGES];
  __shared__ int is_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3, row = lane >> 2;
  u16* out_group = out + ((long long)b * G + g) * GROUP * HEAD_DIM;
  pdl_launch_dependents();

  // Before the wait: the step's inputs (lengths, ring slots, block tables: written before the
  // step's first kernel, which did not use PDL) and the keys of positions < L - 1 (earlier steps).
  // Only the new key at L - 1 and Q come from the kernel before (qk_norm_rope_kv).
  const KvPages pages(block_tables, table_stride, ring_slots, page_rows, b);
  const int L = max(0, seq_lens[b]);
  const int n_keys = window > 0 ? min(L, window) : L;
  const int chunk = split_chunk(n_keys, num_splits, one_split_below);
  const int active = cdiv_i(n_keys, chunk);
  if (n_keys == 0) {  // padding request: no keys, and the sink carries no value -> zeros
    pdl_wait();
    if (split == 0)
      for (int i = threadIdx.x; i < GROUP * HEAD_DIM / 8; i += ATTN_THREADS)
        reinterpret_cast<uint4*>(out_group)[i] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  if (split >= active) return;
  const int begin = L - n_keys + split * chunk, end = min(L, begin + chunk);

  // Each warp streams tiles warp, warp + W, ... through its own ATTN_STAGES-deep ring (load_tile).
  const int kv_row_elems = G * HEAD_DIM;
  const long long head_offset = (long long)g * HEAD_DIM;
  const int n_tiles = cdiv_i(end - begin, ATTN_TILE);
  const int my_tiles = n_tiles > warp ? cdiv_i(n_tiles - warp, ATTN_WARPS) : 0;
  unsigned char* warp_smem = reinterpret_cast<unsigned char*>(attn_smem) + warp * WARP_SMEM_BYTES;
  const u32 stage0 = smem_addr(warp_smem), bar0 = smem_addr(&stage_bars[warp][0]);
  if (lane == 0)
    for (int s = 0; s < ATTN_STAGES; ++s) mbarrier_init(bar0 + 8 * s, ATTN_CP_ASYNC ? 32 : 1);
  fence_mbarrier_init();
  __syncwarp();
  // The first tiles of the pipeline go out before the wait when they end before the new key.
  const int key = lane & 15;
  const auto tile_row = [&](int first) {  // this lane's row in a tile of the prologue
    return first + key < end ? pages.row(first + key) * kv_row_elems + head_offset : -1ll;
  };
  bool early[ATTN_STAGES - 1];
#pragma unroll
  for (int s = 0; s < ATTN_STAGES - 1; ++s) {
    const int first = begin + (warp + s * ATTN_WARPS) * ATTN_TILE;
    early[s] = s < my_tiles && first + ATTN_TILE < L;
    if (early[s])
      load_tile(stage0 + s * STAGE_BYTES, bar0 + 8 * s, k_cache, v_cache, tile_row(first), head_offset,
                min(ATTN_TILE, end - first), lane);
  }
  pdl_wait();
  // Q fragments (A operand rows 0-7 = the 8 heads): qa[kk] = Q[row][16kk + 2t ..], Q[row][16kk + 8 + 2t ..].
  u32 qa[8][2];
#if KV_FP8  // f16, dims 16kk + 4t .. 4t+3 (the K words' order, attend_tile)
  const u16* q_row = q + (long long)b * q_stride + (g * GROUP + row) * HEAD_DIM + 4 * t;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint2 v = *reinterpret_cast<const uint2*>(q_row + 16 * kk);
    qa[kk][0] = pack_f16x2(bf16x2_lo(v.x), bf16x2_hi(v.x));
    qa[kk][1] = pack_f16x2(bf16x2_lo(v.y), bf16x2_hi(v.y));
  }
#else
  const u16* q_row = q + (long long)b * q_stride + (g * GROUP + row) * HEAD_DIM + 2 * t;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    qa[kk][0] = *reinterpret_cast<const u32*>(q_row + 16 * kk);
    qa[kk][1] = *reinterpret_cast<const u32*>(q_row + 16 * kk + 8);
  }
#endif
#pragma unroll
  for (int s = 0; s < ATTN_STAGES - 1; ++s) {
    const int first = begin + (warp + s * ATTN_WARPS) * ATTN_TILE;
    if (s < my_tiles && !early[s])
      load_tile(stage0 + s * STAGE_BYTES, bar0 + 8 * s, k_cache, v_cache, tile_row(first), head_offset,
                min(ATTN_TILE, end - first), lane);
  }
  // The loop's loads: tile ATTN_STAGES - 1 on.
  KeyCursor next(begin + (warp + (ATTN_STAGES - 1) * ATTN_WARPS) * ATTN_TILE + key, pages, end);
  SplitState st;
  st.m = NEG_INF;
  st.l = 0.0f;
#pragma unroll
  for (int n = 0; n < 16; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.0f;
  // Tile i lives in stage i % STAGES; its barrier completes phase i / STAGES (parity (i / STAGES) & 1).
  for (int i = 0; i < my_tiles; ++i) {
    const int ahead = i + ATTN_STAGES - 1;
    if (ahead < my_tiles) {
      const int first = begin + (warp + ahead * ATTN_WARPS) * ATTN_TILE;
      load_tile(stage0 + (ahead % ATTN_STAGES) * STAGE_BYTES, bar0 + 8 * (ahead % ATTN_STAGES), k_cache, v_cache,
                next.row(pages, end, kv_row_elems, head_offset), head_offset, min(ATTN_TILE, end - first), lane);
      next.advance(ATTN_WARPS * ATTN_TILE, pages, end);
    }
    mbarrier_wait_parity(bar0 + 8 * (i % ATTN_STAGES), (i / ATTN_STAGES) & 1);
    __syncwarp();  // the zero rows other lanes stored are visible too
    const u32 stage = stage0 + (i % ATTN_STAGES) * STAGE_BYTES;
    attend_tile(st, qa, stage, stage + TILE_BYTES, begin + (warp + i * ATTN_WARPS) * ATTN_TILE, end, scale_log2,
                lane);
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  st.l += __shfl_xor_sync(0xFFFFFFFFu, st.l, 1);
  st.l += __shfl_xor_sync(0xFFFFFFFFu, st.l, 2);
#if PERSISTENT_STEP  // the next task initializes the barriers again: invalidate them first
  if (lane == 0)
    for (int s = 0; s < ATTN_STAGES; ++s) mbarrier_inval(bar0 + 8 * s);
#endif
  ATTN_SYNC();  // every copy was waited for: the stages become the combine area

  // Per-warp (m, l, o) -> shared: cm[8], cl[8], co[8][COMBINE_STRIDE] at the start of the warp's area.
  float* cm = reinterpret_cast<float*>(warp_smem);
  float* cl = cm + GROUP;
  float* co = cl + GROUP;
  if (t == 0) cm[row] = st.m, cl[row] = st.l;
#if KV_FP8  // n-tiles 2c, 2c + 1: the even and odd dims of chunk c; lane t holds dims 16c + 4t .. 4t+3
#pragma unroll
  for (int c = 0; c < 8; ++c)
    *reinterpret_cast<float4*>(co + row * COMBINE_STRIDE + 16 * c + 4 * t) =
        make_float4(st.o[2 * c][0], st.o[2 * c + 1][0], st.o[2 * c][1], st.o[2 * c + 1][1]);
#else
#pragma unroll
  for (int n = 0; n < 16; ++n)
    *reinterpret_cast<float2*>(co + row * COMBINE_STRIDE + 8 * n + 2 * t) = make_float2(st.o[n][0], st.o[n][1]);
#endif
  ATTN_SYNC();

  // Thread -> (head h, dims d..d+7): combine the warps into this split's (m, l, o).
  const int h = threadIdx.x >> 4, d = (threadIdx.x & 15) * 8;
  const float sink2 = load_sink(sinks, sinks_bf16, g * GROUP + h) * 1.4426950408889634f;
  float m = NEG_INF, l = 0.0f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int w = 0; w < ATTN_WARPS; ++w) {
    const float* wm = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(attn_smem) + w * WARP_SMEM_BYTES);
    float4 lo, hi;
    memcpy(&lo, wm + 2 * GROUP + h * COMBINE_STRIDE + d, 16);
    memcpy(&hi, wm + 2 * GROUP + h * COMBINE_STRIDE + d + 4, 16);
    merge_into(m, l, o, wm[h], wm[GROUP + h], lo, hi);
  }
  if (active == 1) {
    store_final(out_group + h * HEAD_DIM + d, o, m, l, sink2);
    return;
  }

  // Splits merge in a two-level tree, each level closed by the last CTA to take its ticket:
  //   splits 0..15 -> group 0 (into split 0's slot), 16..31 -> group 1 (slot 16), ...
  //   groups 0..n-1 -> out, with the sink
  // so no CTA reads more than MERGE_GROUP partials in a row (one group: the splits go to out).
  const int pair = b * G + g, group = split / MERGE_GROUP, groups = cdiv_i(active, MERGE_GROUP);
  float* pair_partials = partials + (long long)pair * num_splits * PARTIAL_FLOATS;
  store_partial(pair_partials + (long long)split * PARTIAL_FLOATS, h, d, m, l, o);
  if (groups > 1) {
    const int in_group = min(MERGE_GROUP, active - group * MERGE_GROUP);
    if (!take_ticket(tickets + TICKETS_PER_LAUNCH + pair * MAX_GROUPS + group, in_group, &is_last)) return;
    float* group_slot = pair_partials + (long long)group * MERGE_GROUP * PARTIAL_FLOATS;
    m = NEG_INF, l = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.0f;
    merge_partials(group_slot, in_group, h, d, m, l, o);
    ATTN_SYNC();  // every thread has read the group's first slot before it is overwritten
    store_partial(group_slot, h, d, m, l, o);
  }
  if (!take_ticket(tickets + pair, groups > 1 ? groups : active, &is_last)) return;
  // Final: M = max(sink, max_i m_i); out = sum_i 2^(m_i - M) o_i / (sum_i 2^(m_i - M) l_i + 2^(sink - M)).
  m = sink2, l = sink2 == NEG_INF ? 0.0f : 1.0f;  // the sink: a logit whose value vector is zero
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = 0.0f;
  if (groups > 1)
    merge_partials_strided(pair_partials, groups, MERGE_GROUP, h, d, m, l, o);
  else
    merge_partials(pair_partials, active, h, d, m, l, o);
  const float inv = 1.0f / l;
  *reinterpret_cast<uint4*>(out_group + h * HEAD_DIM + d) =
      make_uint4(pack_bf16x2(o[0] * inv, o[1] * inv), pack_bf16x2(o[2] * inv, o[3] * inv),
                 pack_bf16x2(o[4] * inv, o[5] * inv), pack_bf16x2(o[6] * inv, o[7] * inv));
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
decode_attention_bf16(u16* out, const u16* q, int q_stride, const kv_t* k_cache, const kv_t* v_cache,
                      const int* block_tables, int table_stride, const int* ring_slots, int page_rows, int window,
                      const int* seq_lens, int one_split_below, const void* sinks, int sinks_bf16, float scale_log2,
                      u32* tickets, float* partials) {
  decode_attention_cta(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, out, q, q_stride, k_cache, v_cache,
                       block_tables, table_stride, ring_slots, page_rows, window, seq_lens, one_split_below, sinks,
                       sinks_bf16, scale_log2, tickets, partials);
}
