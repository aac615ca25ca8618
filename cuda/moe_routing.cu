// Routing metadata of the grouped MoE path (any number of tokens M), all on the GPU:
//
//   moe_topk:  logits fp32 [parts, M, E] (split-K partial products, summed in order) -> ids int32
//              [M, A], weights fp32 [M, A] (one warp per token, router.cu's sigmoid and selection;
//              tokens t >= num_tokens are skipped)
//   moe_sort:  one CTA; (token, slot) pairs p = t * (A + 1) + a, slot A = the shared expert
//              (id E), counting-sorted by expert, stable (pair order within an expert):
//
//     offsets      [E + 2]      rows of expert e: offsets[e] .. offsets[e + 1] - 1
//     sorted_token [P]          token of each sorted row (P = num_tokens * (A + 1) rows used)
//     pair_row     [M, A + 1]   sorted row of each pair; -1 for padded tokens
//     queue        [num_work + 1] zeroed: expert_decode_moe's unit counters (expert_decode.cu)
//     work list    items of <= chunk rows of one expert, an expert's items adjacent:
//                  work_expert[i], work_row[i] (first sorted row), num_work[0] items; with
//                  heavy_first, experts of more than chunk / 2 rows first (sort_pairs)
//     split list   with split > 0, the experts of more than `split` rows are not in the work list
//                  but in a second one of items of <= big_chunk rows (work2_expert, work2_row,
//                  num_work2): the tiled expert GEMMs take those, the decode GEMMs the rest
//
//   moe_route: both in one launch: every CTA selects for its tokens, the last CTA to take the
//              ticket sorts and resets the ticket (so a CUDA graph replays it); a grid of one
//              CTA (<= 16 tokens) sorts its ids from shared memory, no ticket or fences, and the
//              last CTA stages up to STAGED_IDS ids there first. The bias (a weight) is read
//              before waiting on the logits. Up to MASK_TOKENS tokens the sort counts and ranks
//              by per-expert token masks (sort_pairs), same result.
//   moe_finalize: out[t] = bf16(residual[t] + sum_{a<A} w[t,a] y[pair_row[t,a]] + y[pair_row[t,A]])
//              in fp32, slots in order then the shared expert; padded tokens copy residual.
//   moe_finalize_norm: the same, one CTA per token, and norm_out[t] = rms_norm(out[t]) * norm_weight
//              (norm.cuh): the next layer's input norm in the same pass.
#include "norm.cuh"
#include "topk.cuh"

#define ROUTING_WARPS 16  // kernels/grouped_moe.py ROUTING_THREADS / 32
#define MAX_TOP_K 32      // kernels/grouped_moe.py MAX_TOP_K
#define STAGED_IDS 2048   // kernels/grouped_moe.py STAGED_IDS: moe_route's last CTA stages this many ids
#ifndef MASK_TOKENS
#define MASK_TOKENS 256   // moe_route sorts up to this many tokens by token masks (sort_pairs); a multiple of 32
#endif
#define MASK_WORDS (MASK_TOKENS / 32)

__device__ __forceinline__ int num_real(const int* num_tokens, int M) {
  return num_tokens ? min(M, *num_tokens) : M;
}

// Warp `warp` of this CTA: token blockIdx.x * ROUTING_WARPS + warp; bias: lane_values of the
// bias; ids_copy: [ROUTING_WARPS][A] of this CTA's tokens, or null. logits: router_scores'.
__device__ __forceinline__ void topk_tokens(int* ids, float* weights, const float* logits, int parts, int M,
                                            const float (&bias)[ROUTER_PER_LANE], int ntok, int E, int A,
                                            float scaling, int* ids_copy) {
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * ROUTING_WARPS + warp;
  if (t >= ntok) return;
  float s[ROUTER_PER_LANE];
  router_scores(s, logits, parts, M, t, E);
  router_select(ids + t * A, weights + t * A, s, bias, E, A, scaling, ids_copy ? ids_copy + warp * A : nullptr);
}

// In-place exclusive scan of v[0..n) (v[n] <- total) by the whole CTA; n + 1 <= blockDim * 4.
__device__ __forceinline__ void block_exclusive_scan(u64* v, int n, u64* warp_total) {
  const int per = (n + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
  u64 mine = 0;
  for (int i = first; i < min(n, first + per); ++i) mine += v[i];
  u64 total;
  u64 before = block_exclusive_sum(mine, warp_total, total);  // every v read through `mine`: now overwrite
  for (int i = first; i < min(n, first + per); ++i) {
    const u64 x = v[i];
    v[i] = before;
    before += x;
  }
  if (threadIdx.x == 0) v[n] = total;
  __syncthreads();
}

struct Sorted {
  int* queue;  // expert_decode_moe's unit queue: num_work + 1 counters, zeroed here
  int* offsets;
  int* sorted_token;
  int* pair_row;
  int* work_expert;
  int* work_row;
  int* num_work;
  int* work2_expert;  // the split list (split > 0)
  int* work2_row;
  int* num_work2;
};

// Shared memory of sort_pairs (a multiple of 16 bytes); moe_route stages up to STAGED_IDS ids after it.
__device__ __forceinline__ int sort_smem_bytes(int E) {
  return ((ROUTING_WARPS * (E + 1) * 4 + 15) & ~15) + (E + 2) * 8 + 32 * 8;
}

// The whole CTA (ROUTING_WARPS warps). ids: in this CTA's shared memory (SMEM_IDS), or written by
// another CTA or kernel: read from L2. smem: hist [ROUTING_WARPS][E + 1] int, then scan [E + 2] u64, then
// warp totals [32] u64.
template <bool SMEM_IDS>
__device__ __forceinline__ void sort_pairs(const Sorted& out, const int* ids, int ntok, int M,
                                           int A, int E, int chunk, bool heavy_first, int split, int big_chunk,
                                           unsigned char* smem) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, bins = E + 1;
  int* hist = reinterpret_cast<int*>(smem);
  u64* scan = reinterpret_cast<u64*>(smem + ((ROUTING_WARPS * bins * 4 + 15) & ~15));
  u64* warp_total = scan + bins + 1;
  const int slots = A + 1, P = ntok * slots;
  // Warp w owns pairs [p_begin, p_end), in order: at 16 tokens, 7 each. (One warp per 64 pairs,
  // its atomics and scatter iterations one after another, measured slower: 13.5 µs at 16 tokens.)
  const int p_begin = (int)((long long)P * warp / ROUTING_WARPS);
  const int p_end = (int)((long long)P * (warp + 1) / ROUTING_WARPS);
  auto expert_of = [&](int p) {
    const int t = p / slots, a = p - t * slots;
    return a < A ? (SMEM_IDS ? ids[t * A + a] : __ldcg(ids + t * A + a)) : E;
  };
  // Up to MASK_TOKENS tokens with the ids in shared memory (moe_route): hist holds a token mask
  // per expert instead, [E][MASK_WORDS] (zeroed by the caller before its PDL wait): bit t of expert
  // e set when token t chose e. An expert's count is its mask's popcount and a pair's rank within
  // its expert the popcount of the tokens before it: one atomicOr a pair, no per-warp histograms
  // (a token chooses an expert once, so token order is pair order). The shared expert E takes
  // every token: count ntok, rank t.
  const bool masks = SMEM_IDS && ntok <= MASK_TOKENS;
  u32* mask = reinterpret_cast<u32*>(smem);
  auto mask_rank = [&](int e, int t) {  // tokens before t that chose e
    if (e == E) return t;
    int r = __popc(mask[e * MASK_WORDS + (t >> 5)] & ((1u << (t & 31)) - 1u));
    for (int w = 0; w < (t >> 5); ++w) r += __popc(mask[e * MASK_WORDS + w]);
    return r;
  };
  if (masks) {
    for (int i = tid; i < ntok * A; i += blockDim.x)  // routed pair i: token i / A
      atomicOr(&mask[ids[i] * MASK_WORDS + i / A / 32], 1u << (i / A % 32));
  } else {
    for (int i = tid; i < ROUTING_WARPS * bins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int p = p_begin + lane; p < p_end; p += 32) atomicAdd(&hist[warp * bins + expert_of(p)], 1);
  }
  __syncthreads();
  // Per expert: counts of warps -> exclusive prefix over warps; scan value = heavy items << 48 |
  // light items << 32 | count, where an expert is heavy (heavy_first) if it has more than chunk / 2
  // rows: the work list holds the heavy experts' items first, so the longest items start in the
  // first waves of CTAs and the last wave is of short ones. Either way an expert's items are
  // adjacent and in row order. With split > 0 the "heavy" experts are those of more than `split`
  // rows, in items of big_chunk rows, and their items go to the split list instead.
  for (int e = tid; e < bins; e += blockDim.x) {
    int count = 0;
    if (masks) {
      if (e == E) count = ntok;
      else
        for (int w = 0; w < MASK_WORDS; ++w) count += __popc(mask[e * MASK_WORDS + w]);
    } else {
      for (int w = 0; w < ROUTING_WARPS; ++w) {
        const int c = hist[w * bins + e];
        hist[w * bins + e] = count;
        count += c;
      }
    }
    if (split > 0 && count > split)
      scan[e] = ((u64)((count + big_chunk - 1) / big_chunk) << 48) | (u64)count;
    else {
      const u64 items = (count + chunk - 1) / chunk;
      scan[e] = (heavy_first && split <= 0 && 2 * count > chunk ? items << 48 : items << 32) | (u64)count;
    }
  }
  __syncthreads();
  block_exclusive_scan(scan, bins, warp_total);
  const int heavy_total = (int)(scan[bins] >> 48), light_total = (int)((scan[bins] >> 32) & 0xFFFFu);
  for (int e = tid; e <= bins; e += blockDim.x) out.offsets[e] = (int)(u32)scan[e];
  const int num_work = split > 0 ? light_total : heavy_total + light_total;
  if (tid == 0) {
    *out.num_work = num_work;
    if (split > 0) *out.num_work2 = heavy_total;
  }
  for (int i = tid; i <= num_work; i += blockDim.x) out.queue[i] = 0;
  for (int e = tid; e < bins; e += blockDim.x) {
    const int row = (int)(u32)scan[e];
    const int heavy = (int)(scan[e] >> 48), light = (int)((scan[e] >> 32) & 0xFFFFu);
    const int heavy_items = (int)(scan[e + 1] >> 48) - heavy;
    const int items = heavy_items ? heavy_items : (int)((scan[e + 1] >> 32) & 0xFFFFu) - light;
    const bool to_split = split > 0 && heavy_items;  // the split list; else the work list, heavy first
    const int item = heavy_items ? heavy : split > 0 ? light : heavy_total + light;
    int* const we = to_split ? out.work2_expert : out.work_expert;
    int* const wr = to_split ? out.work2_row : out.work_row;
    const int step = to_split ? big_chunk : chunk;
    if (!masks)
      for (int w = 0; w < ROUTING_WARPS; ++w) hist[w * bins + e] += row;
    for (int j = 0; j < items; ++j) {
      we[item + j] = e;
      wr[item + j] = row + j * step;
    }
  }
  __syncthreads();
  if (masks) {
    for (int p = tid; p < P; p += blockDim.x) {
      const int t = p / slots, e = expert_of(p);
      const int row = (int)(u32)scan[e] + mask_rank(e, t);
      out.sorted_token[row] = t;
      out.pair_row[p] = row;
    }
    for (int i = P + tid; i < M * slots; i += blockDim.x) out.pair_row[i] = -1;
    return;
  }
  // Stable scatter: lanes naming the same expert take consecutive rows in lane order.
  for (int p0 = p_begin; p0 < p_end; p0 += 32) {
    const int p = p0 + lane, t = p / slots;
    const int e = p < p_end ? expert_of(p) : -1;
    const u32 same = __match_any_sync(0xFFFFFFFFu, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    int row = 0;
    if (e >= 0) row = hist[warp * bins + e] + rank;
    __syncwarp();
    if (e >= 0 && rank == 0) hist[warp * bins + e] += __popc(same);
    __syncwarp();
    if (e >= 0) {
      out.sorted_token[row] = t;
      out.pair_row[p] = row;
    }
  }
  for (int i = P + tid; i < M * slots; i += blockDim.x) out.pair_row[i] = -1;
}

__device__ __forceinline__ Sorted sorted_of(int* queue, int* offsets, int* sorted_token, int* pair_row,
                                            int* work_expert, int* work_row, int* num_work, int* work2_expert,
                                            int* work2_row, int* num_work2) {
  return {queue, offsets, sorted_token, pair_row, work_expert, work_row, num_work, work2_expert, work2_row, num_work2};
}

// moe_sort and moe_route: dynamic shared memory of the sort's size (kernels/grouped_moe.py
// routing_shared_bytes); moe_topk takes none.
extern "C" __global__ void __launch_bounds__(ROUTING_WARPS * 32)
moe_topk(int* ids, float* weights, const float* logits, int parts, const float* bias,
         const int* num_tokens, int M, int E, int A, float scaling) {
  float b[ROUTER_PER_LANE];
  lane_values(b, bias, E);  // a weight: before the wait
  pdl_launch_dependents();
  pdl_wait();
  topk_tokens(ids, weights, logits, parts, M, b, num_real(num_tokens, M), E, A, scaling, nullptr);
}

extern "C" __global__ void __launch_bounds__(ROUTING_WARPS * 32)
moe_sort(int* queue, int* offsets, int* sorted_token, int* pair_row, int* work_expert, int* work_row,
         int* num_work, int* work2_expert, int* work2_row, int* num_work2, const int* ids, const int* num_tokens,
         int M, int E, int A, int chunk, int heavy_first, int split, int big_chunk) {
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_launch_dependents();
  pdl_wait();
  sort_pairs<false>(sorted_of(queue, offsets, sorted_token, pair_row, work_expert, work_row, num_work, work2_expert,
                              work2_row, num_work2),
                    ids, num_real(num_tokens, M), M, A, E, chunk, heavy_first, split, big_chunk, smem);
}

extern "C" __global__ void __launch_bounds__(ROUTING_WARPS * 32, 1)
moe_route(int* ids, float* weights, int* queue, int* offsets, int* sorted_token, int* pair_row,
          int* work_expert, int* work_row, int* num_work, int* work2_expert, int* work2_row, int* num_work2,
          u32* ticket, const float* logits, int parts, const float* bias, const int* num_tokens, int M, int E, int A,
          float scaling, int chunk, int heavy_first, int split, int big_chunk) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ids_s[ROUTING_WARPS * MAX_TOP_K];  // one CTA: the ids the sort reads
  __shared__ u32 is_last;
  float b[ROUTER_PER_LANE];
  lane_values(b, bias, E);  // a weight: before the wait
  // sort_pairs' token masks (any CTA may be the one that sorts): zeroed before the wait
  for (int i = threadIdx.x; i < E * MASK_WORDS; i += blockDim.x) reinterpret_cast<u32*>(smem)[i] = 0u;
  pdl_launch_dependents();
  pdl_wait();
  const int ntok = num_real(num_tokens, M);
  const Sorted sorted = sorted_of(queue, offsets, sorted_token, pair_row, work_expert, work_row, num_work,
                                  work2_expert, work2_row, num_work2);
  const bool one_cta = gridDim.x == 1;  // <= ROUTING_WARPS tokens: no ticket, ids stay in shared memory
  topk_tokens(ids, weights, logits, parts, M, b, ntok, E, A, scaling, one_cta ? ids_s : nullptr);
  __syncthreads();
  if (one_cta) return sort_pairs<true>(sorted, ids_s, ntok, M, A, E, chunk, heavy_first, split, big_chunk, smem);
  // Last-block pattern (router.cu): barrier, fence, ticket; the last CTA fences before reading.
  if (threadIdx.x == 0) is_last = ticket_arrive(ticket) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  ticket_acquire();
  if (threadIdx.x == 0) *ticket = 0u;
  const int n_ids = ntok * A;
  if (n_ids > STAGED_IDS)
    return sort_pairs<false>(sorted, ids, ntok, M, A, E, chunk, heavy_first, split, big_chunk, smem);
  // The other CTAs' ids into shared memory, all loads in flight at once: the sort reads each twice.
  int* staged = reinterpret_cast<int*>(smem + sort_smem_bytes(E));
#pragma unroll 4
  for (int i = threadIdx.x; i < n_ids; i += blockDim.x) staged[i] = __ldcg(ids + i);
  __syncthreads();
  sort_pairs<true>(sorted, staged, ntok, M, A, E, chunk, heavy_first, split, big_chunk, smem);
}

// out[t, c..c+7] as bf16 words: residual + the weighted expert rows + the shared expert's row.
__device__ __forceinline__ void finalize_vec(u32 (&o)[4], const uint4& r, const u16* y_sorted,
                                             const int* pair_row, const float* weights, int t, int c,
                                             int N, int A) {
  float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 7
  for (int a = 0; a <= A; ++a) {
    const int row = pair_row[t * (A + 1) + a];
    const float w = a < A ? weights[t * A + a] : 1.0f;
    const uint4 y = ld_act_v4(y_sorted + (size_t)row * N + c);
    const u32 v[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sum[2 * j] = fmaf(w, bf16x2_lo(v[j]), sum[2 * j]);
      sum[2 * j + 1] = fmaf(w, bf16x2_hi(v[j]), sum[2 * j + 1]);
    }
  }
  const u32 rv[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    o[j] = pack_bf16x2(bf16x2_lo(rv[j]) + sum[2 * j], bf16x2_hi(rv[j]) + sum[2 * j + 1]);
}

// One thread per 8 outputs (16 bytes) of one token; N % 8 == 0. out may alias residual.
extern "C" __global__ void __launch_bounds__(256)
moe_finalize(u16* out, const u16* residual, const u16* y_sorted, const int* pair_row,
             const float* weights, const int* num_tokens, int M, int N, int A) {
  pdl_launch_dependents();
  pdl_wait();
  const int per_row = N / 8;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)M * per_row) return;
  const int t = (int)(i / per_row), c = (int)(i - (long long)t * per_row) * 8;
  const uint4 r = ld_act_v4(residual + (size_t)t * N + c);
  if (t >= num_real(num_tokens, M)) {
    *reinterpret_cast<uint4*>(out + (size_t)t * N + c) = r;
    return;
  }
  u32 o[4];
  finalize_vec(o, r, y_sorted, pair_row, weights, t, c, N, A);
  *reinterpret_cast<uint4*>(out + (size_t)t * N + c) = make_uint4(o[0], o[1], o[2], o[3]);
}

// One CTA per token (N / 8 vectors over its threads, N <= 8 * NORM_MAX_VEC * blockDim.x). out may
// alias residual; padded tokens copy residual and normalize it.
extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
moe_finalize_norm(u16* out, u16* norm_out, const u16* residual, const u16* y_sorted,
                  const int* pair_row, const float* weights, const u16* norm_weight,
                  const int* num_tokens, int M, int N, int A, float eps) {
  pdl_launch_dependents();
  const int t = blockIdx.x, num_vec = N / 8;
  uint4 wv[NORM_MAX_VEC];
  norm_weight_load(wv, norm_weight, num_vec);
  pdl_wait();
  const bool real = t < num_real(num_tokens, M);
  float s[NORM_MAX_VEC][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_MAX_VEC; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= num_vec) break;
    const uint4 r = ld_act_v4(residual + (size_t)t * N + 8 * v);
    u32 o[4] = {r.x, r.y, r.z, r.w};
    if (real) finalize_vec(o, r, y_sorted, pair_row, weights, t, 8 * v, N, A);
    *reinterpret_cast<uint4*>(out + (size_t)t * N + 8 * v) = make_uint4(o[0], o[1], o[2], o[3]);
    sum_sq = norm_unpack(s[i], o, sum_sq);
  }
  norm_store(norm_out + (size_t)t * N, s, wv, sum_sq, N, eps);
}
