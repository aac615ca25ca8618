// Sigmoid-router selection shared by router.cu and moe_routing.cu: top-A of (score + bias) per
// token, ties to the lower expert id, weights = chosen scores / their sum * scaling, ids in
// descending order of score + bias (as torch.topk in model/reference.py route()).
// ROUTER_MAX_EXPERTS (256 or 1024) is a compile-time define: 32 experts per lane at most.
#pragma once
#include "common.cuh"

#ifndef ROUTER_MAX_EXPERTS
#define ROUTER_MAX_EXPERTS 256
#endif
#define ROUTER_PER_LANE (ROUTER_MAX_EXPERTS / 32)

// Order-preserving map of a float to an unsigned key (larger float, larger key); -0.0 sorts just
// below +0.0, the only pair of equal floats it tells apart.
__device__ __forceinline__ u32 order_key(float f) {
  const u32 u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
  u32 r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ u32 warp_min_u32(u32 v) {
  u32 r;
  asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

// One warp: top-A of scores[e] + bias[e] over E <= ROUTER_MAX_EXPERTS experts; lane owns experts
// lane + 32 i, held in registers (unrolled loops: no local memory). Each round takes the warp's
// largest key, then the lowest expert id holding it (two redux.sync instead of a shuffle tree);
// taken ones become -inf.
// The lane's values of experts lane + 32 i (0 past E): bias (a weight: read it before pdl_wait
// where the caller can), scores. All loads issued before the first use.
__device__ __forceinline__ void lane_values(float (&v)[ROUTER_PER_LANE], const float* p, int E) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ROUTER_PER_LANE; ++i) v[i] = lane + 32 * i < E ? p[lane + 32 * i] : 0.0f;
}

#ifndef MAX_LOGIT_PARTS
#define MAX_LOGIT_PARTS 8  // kernels/grouped_moe.py MAX_LOGIT_PARTS: split-K parts of the router logits
#endif

// The lane's sigmoid scores of token t (experts lane + 32 i) from fp32 logits that are the sum of
// `parts` split-K partial products [parts][M][E] (1 <= parts <= MAX_LOGIT_PARTS), added in order,
// so every kernel that routes (moe_routing.cu, the routed decode MoE in expert_decode.cu) gets the
// same bits.
__device__ __forceinline__ void router_scores(float (&s)[ROUTER_PER_LANE], const float* logits, int parts, int M,
                                              int t, int E) {
  lane_values(s, logits + (size_t)t * E, E);
#if ROUTER_PER_LANE <= 8
  float part[MAX_LOGIT_PARTS - 1][ROUTER_PER_LANE];
#pragma unroll
  for (int q = 1; q < MAX_LOGIT_PARTS; ++q)  // every part's loads in flight before the first add
    if (q < parts) lane_values(part[q - 1], logits + ((size_t)q * M + t) * E, E);
#pragma unroll
  for (int q = 1; q < MAX_LOGIT_PARTS; ++q)
    if (q < parts) {
#pragma unroll
      for (int i = 0; i < ROUTER_PER_LANE; ++i) s[i] += part[q - 1][i];
    }
#else  // 32 experts a lane: a part at a time (all of them at once would spill), the same order
#pragma unroll 1
  for (int q = 1; q < parts; ++q) {
    float part[ROUTER_PER_LANE];
    lane_values(part, logits + ((size_t)q * M + t) * E, E);
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i) s[i] += part[i];
  }
#endif
#pragma unroll
  for (int i = 0; i < ROUTER_PER_LANE; ++i) s[i] = 1.0f / (1.0f + expf(-s[i]));
}

// score: sigmoid of the lane's logits (lane_values), bias: the lane's bias. ids_copy: the ids
// also written there (the sort's shared-memory copy), or null.
__device__ __forceinline__ void router_select(int* ids, float* weights, const float (&score)[ROUTER_PER_LANE],
                                              const float (&bias)[ROUTER_PER_LANE], int E, int A,
                                              float scaling, int* ids_copy = nullptr) {
  const float neg_inf = -__int_as_float(0x7F800000);
  const int lane = threadIdx.x & 31;
  float sel[ROUTER_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROUTER_PER_LANE; ++i) sel[i] = lane + 32 * i < E ? score[i] + bias[i] : neg_inf;
  int my_id = 0;
  float my_weight = 0.0f;
  for (int j = 0; j < A; ++j) {
    float best = neg_inf;
    int best_i = 0;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i)
      if (sel[i] > best) {  // strict: the lowest i (lowest expert id of this lane) wins ties
        best = sel[i];
        best_i = i;
      }
    const u32 key = best > neg_inf ? order_key(best) : 0u;
    const u32 top = warp_max_u32(key);
    const int best_e = (int)warp_min_u32(key == top && best > neg_inf ? (u32)(lane + 32 * best_i) : 0xFFFFFFFFu);
    // The winner leaves the race; its owner lane holds its score. Compared by expert id, not by
    // register index (sel[best_e >> 5] would become a local-memory array).
    float chosen = 0.0f;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i) {
      const bool won = lane + 32 * i == best_e;
      sel[i] = won ? neg_inf : sel[i];
      chosen = won ? score[i] : chosen;
    }
    chosen = __shfl_sync(0xFFFFFFFFu, chosen, best_e & 31);
    if (lane == j) {
      my_id = best_e;
      my_weight = chosen;
    }
  }
  const float total = warp_sum(lane < A ? my_weight : 0.0f);
  if (lane < A) {
    ids[lane] = my_id;
    weights[lane] = my_weight / total * scaling;
    if (ids_copy) ids_copy[lane] = my_id;
  }
}

// scores, bias: [E] in memory (scores in shared memory, written by this warp).
__device__ __forceinline__ void router_select(int* ids, float* weights, const float* scores,
                                              const float* bias, int E, int A, float scaling) {
  float s[ROUTER_PER_LANE], b[ROUTER_PER_LANE];
  lane_values(s, scores, E);
  lane_values(b, bias, E);
  router_select(ids, weights, s, b, E, A, scaling);
}
