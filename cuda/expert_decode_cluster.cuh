// The decode MoE's thread-block-cluster kernels (ED_CLUSTER configs): part of expert_decode.cu,
// included there at its end, after the units and macros they use (expert_decode_unit, Q_ARGS, Q,
// WORK_ARGS); see expert_decode.cu's header for the units and the work list.
#pragma once
#include "topk.cuh"  // the routed kernel's top-k (router_scores, router_select)

// ---- the same in one launch, an item's units as one thread block cluster ------------------------
// (configs ...c, kernels/expert_decode.py expert_decode_moe): cluster i takes item i of the work list
// (clusters past num_work exit at once), its CTA r the item's gate/up tile group r and then its down
// tile group r (the config has as many of each as the cluster has CTAs). A CTA arrives at the
// cluster barrier once its h columns are written, loads its first down weights, then waits there
// for the item's other gate/up units and stages the item's h rows from L2. No queue: the down work
// runs in the CTAs that did the gate/up work (in the queue kernel a down unit is a CTA that starts,
// builds its table and stages only as a gate/up CTA ends), and a down unit waits on its own item
// alone. Clusters are co-scheduled, so no CTA waits on one that has not started.
// The item's gate/up tile group `group`, then (after the cluster's barrier) its down tile group.
// gather: sorted_token, or with LOCAL_GATHER this CTA's shared list of the item's tokens.
template <bool LOCAL_GATHER>
__device__ __forceinline__ void cluster_item(u16* y, u16* h, const u16* x, const int* gather,
                                             const EdWeights (&gate_up)[4], const EdWeights (&down)[4], int expert,
                                             int row0, int rows, int I, int H, int E, int group) {
  expert_decode_unit<true, true, LOCAL_GATHER>(h, x, gather, gate_up, expert, row0, rows, I, H, E, group);
#if !TICKET_ACQ_REL  // (with it: the cluster barrier's release orders them, a MEMBAR.ALL.GPU of its own)
  __threadfence();  // this thread's h stores, before the barrier the item's down units wait at
#endif
  cluster_arrive_release();
  expert_decode_unit<false, true>(y, h, nullptr, down, expert, row0, rows, H, I, E, group);
}

extern "C" __global__ void __cluster_dims__(ED_CLUSTER, 1, 1) __launch_bounds__(ED_WARPS * 32, ED_MIN_CTAS)
expert_decode_moe_cluster_nvfp4(u16* y, u16* h, const u16* x, const int* sorted_token, Q_ARGS(g), Q_ARGS(u),
                                Q_ARGS(sg), Q_ARGS(su), Q_ARGS(d), Q_ARGS(sd), WORK_ARGS, int I, int H, int E) {
  extern __shared__ __align__(16) unsigned char smem[];
  u32* table = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = ue4m3_scale_bf16x2(i);
  pdl_wait();  // the work list comes from the routing launch
  pdl_launch_dependents();
  const int item = blockIdx.x / ED_CLUSTER, group = (int)cluster_ctarank();
  if (item >= __ldcg(num_work)) return;  // every CTA of the cluster: the same item
  const int expert = __ldcg(work_expert + item), row0 = __ldcg(work_row + item);
  const int rows = min(ED_ROWS, __ldcg(offsets + expert + 1) - row0);
  const EdWeights gate_up[4] = {Q(g), Q(u), Q(sg), Q(su)}, down[4] = {Q(d), Q(d), Q(sd), Q(sd)};
  cluster_item<false>(y, h, x, sorted_token, gate_up, down, expert, row0, rows, I, H, E, group);
}

// ---- the same with the routing inside (expert_decode_moe_routed_nvfp4; kernels/expert_decode.py
// expert_decode_moe_routed): at <= 16 tokens moe_route was ~9 µs of each layer's critical path
// (its launch, a top-k of 2.8 µs, a one-CTA sort of 3.4) before the expert GEMMs could start.
// Here every cluster routes for itself from the router's logits (the same router_scores and
// router_select as moe_route, so the same ids and weights bit for bit):
//   1. the top-k, one token a warp of the cluster (ED_CLUSTER * ED_WARPS >= M), each token's ids
//      stored into every CTA's shared memory;
//   2. every CTA: per-expert token masks (bit t: token t chose the expert), counts, and one scan
//      giving each expert's first sorted row and first item (experts in id order, the shared
//      expert E last with every token; items of <= ED_ROWS rows, an expert's rows in token order,
//      as moe_sort orders them);
//   3. cluster i takes item i (the clusters past the item count exit), its tokens the set bits of
//      its expert's mask from the item's rank.
// Cluster 0 also writes what moe_finalize and the tests read: ids, weights, pair_row (-1 for
// padded tokens), offsets and the work list (no queue: the kernel takes none); each cluster writes
// its item's sorted_token rows. M <= ED_ROUTE_MAX_TOKENS (one mask word), A <= ED_ROUTE_MAX_TOP_K.
#define ED_ROUTE_MAX_TOKENS 32
#define ED_ROUTE_MAX_TOP_K 16
static_assert(ED_CLUSTER * ED_WARPS >= ED_ROUTE_MAX_TOKENS, "a warp of the cluster per routed token");

extern "C" __global__ void __cluster_dims__(ED_CLUSTER, 1, 1) __launch_bounds__(ED_WARPS * 32, ED_MIN_CTAS)
expert_decode_moe_routed_nvfp4(u16* y, u16* h, const u16* x, int* sorted_token, int* ids, float* weights,
                               int* pair_row, int* offsets, int* work_expert, int* work_row, int* num_work,
                               Q_ARGS(g), Q_ARGS(u), Q_ARGS(sg), Q_ARGS(su), Q_ARGS(d), Q_ARGS(sd),
                               const float* logits, int parts, const float* bias, const int* num_tokens, int M,
                               int A, float scaling, int I, int H, int E) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int route_ids[ED_ROUTE_MAX_TOKENS * ED_ROUTE_MAX_TOP_K];  // [token][slot], every CTA's copy
  __shared__ int sel_ids[ED_WARPS][ED_ROUTE_MAX_TOP_K];                // router_select's output (clusters > 0)
  __shared__ float sel_weights[ED_WARPS][ED_ROUTE_MAX_TOP_K];
  __shared__ u32 mask[ROUTER_MAX_EXPERTS];
  __shared__ int first_row[ROUTER_MAX_EXPERTS + 2];  // [E + 2]: offsets
  __shared__ u32 warp_total[ED_WARPS];
  __shared__ int item_s[3];                          // expert, first row, rows
  __shared__ int tokens_s[ED_ROWS];
  u32* table = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = ue4m3_scale_bf16x2(i);
  for (int e = threadIdx.x; e < E; e += blockDim.x) mask[e] = 0;
  cluster_arrive_relaxed();  // every CTA started: the top-k may store into their shared memory
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rank = (int)cluster_ctarank(), item = blockIdx.x / ED_CLUSTER;
  const int t = rank * ED_WARPS + warp;  // this warp's token in the top-k
  float b[ROUTER_PER_LANE];
  lane_values(b, bias, E);  // a weight: before the wait
  pdl_wait();  // the logits come from the launch before
  pdl_launch_dependents();
  const int ntok = num_tokens ? min(M, __ldcg(num_tokens)) : M;

  // 1. top-k; cluster 0 writes the real ids and weights
  int my_id = 0;
  if (t < ntok) {
    float s[ROUTER_PER_LANE];
    router_scores(s, logits, parts, M, t, E);
    int* out_ids = item == 0 ? ids + t * A : sel_ids[warp];
    router_select(out_ids, item == 0 ? weights + t * A : sel_weights[warp], s, b, E, A, scaling);
    if (lane < A) my_id = out_ids[lane];  // this lane's own store
  }
  cluster_wait_acquire();
  if (t < ntok && lane < A) {
    const u32 at = (u32)__cvta_generic_to_shared(route_ids + t * A + lane);
#pragma unroll
    for (int q = 0; q < ED_CLUSTER; ++q) st_cluster_u32(cluster_map(at, q), (u32)my_id);
  }
  cluster_arrive_release();
  cluster_wait_acquire();

  // 2. masks, counts, each expert's first row and first item
  for (int p = threadIdx.x; p < ntok * A; p += blockDim.x) atomicOr(&mask[route_ids[p]], 1u << (p / A));
  __syncthreads();
  const int bins = E + 1, per = (bins + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * per;
  const int e1 = min(bins, e0 + per);
  auto count_of = [&](int e) { return e == E ? ntok : __popc(mask[e]); };
  u32 mine = 0;  // rows << 16 | items (both < 2^16: M * (A + 1) rows at most)
  for (int e = e0; e < e1; ++e) {
    const int c = count_of(e);
    mine += (u32)c << 16 | (u32)((c + ED_ROWS - 1) / ED_ROWS);
  }
  u32 total;
  u32 run = block_exclusive_sum(mine, warp_total, total);
  for (int e = e0; e < e1; ++e) {
    const int c = count_of(e), items = (c + ED_ROWS - 1) / ED_ROWS, first_item = (int)(run & 0xFFFFu);
    first_row[e] = (int)(run >> 16);
    if (item >= first_item && item < first_item + items) {
      const int k = item - first_item;
      item_s[0] = e, item_s[1] = (int)(run >> 16) + k * ED_ROWS, item_s[2] = min(ED_ROWS, c - k * ED_ROWS);
    }
    run += (u32)c << 16 | (u32)items;
  }
  if (threadIdx.x == 0) first_row[bins] = (int)(total >> 16);
  __syncthreads();
  const int num_items = (int)(total & 0xFFFFu);

  // cluster 0: the pairs' rows, offsets, item count (its CTAs share the work)
  if (item == 0) {
    const int stride = ED_CLUSTER * blockDim.x, first = rank * blockDim.x + threadIdx.x;
    for (int p = first; p < M * (A + 1); p += stride) {
      const int tok = p / (A + 1), a = p - tok * (A + 1);
      int row = -1;
      if (tok < ntok) {
        const int e = a == A ? E : route_ids[tok * A + a];
        row = first_row[e] + (e == E ? tok : __popc(mask[e] & ((1u << tok) - 1u)));
      }
      pair_row[p] = row;
    }
    for (int e = first; e <= bins; e += stride) offsets[e] = first_row[e];
    if (first == 0) *num_work = num_items;
  }
  if (item >= num_items) return;  // every CTA of the cluster: the same count

  // 3. this cluster's item: its tokens, the set bits of its expert's mask from its rank on
  const int expert = item_s[0], row0 = item_s[1], rows = item_s[2];
  if (threadIdx.x < rows) {
    const int rank_in = row0 - first_row[expert] + threadIdx.x;
    int tok = rank_in;  // the shared expert: token = rank
    if (expert < E) {
      u32 m = mask[expert];
      for (int k = 0; k < rank_in; ++k) m &= m - 1u;  // drop the lowest set bits
      tok = __ffs(m) - 1;
    }
    tokens_s[threadIdx.x] = tok;
    if (rank == 0) sorted_token[row0 + threadIdx.x] = tok;
  }
  if (rank == 0 && threadIdx.x == 0) work_expert[item] = expert, work_row[item] = row0;
  __syncthreads();
  const EdWeights gate_up[4] = {Q(g), Q(u), Q(sg), Q(su)}, down[4] = {Q(d), Q(d), Q(sd), Q(sd)};
  cluster_item<true>(y, h, x, tokens_s, gate_up, down, expert, row0, rows, I, H, E, rank);
}
