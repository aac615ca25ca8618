// The Q/K norm + RoPE + K/V write of one attention CTA's KV head, done by the attention CTA itself
// (cuda/decode_step.cu STEP_FUSE_QK, cuda/decode_attention.cu ATTN_FUSE_QK) instead of by the
// qk_norm_rope_kv kernel before it: qk_norm_rope_kv.cu's arithmetic (qk_norm_rope.cuh), the same
// bits, one dependent hop a layer fewer. Only the split whose keys end at the new key reads the new
// K/V row this step, so that split writes it, then reads it through its own bulk copies.
#pragma once
#include "qk_norm_rope.cuh"

// NOTE: rope_table's fp64 sincos in a function of its own: inlined beside the attention body it
// added to the kernel's registers.
__device__ __noinline__ void rope_table_apart(float* cos_s, float* sin_s, int p, const double* inv_freq) {
  rope_table(cos_s, sin_s, p, inv_freq);
}

// Attention CTA (b, g) doing the Q/K norm operation's part itself: the 8 query heads of KV head g
// of row b normalized (and rotated, with inv_freq) into q_slot [H][128] at their heads' places; with
// writes_kv (the split holding the new key: fused_qk_writes_kv below) also the K row (normalized,
// rotated) and the V row of head g at the row's position. Every thread (warp w: heads w, w + warps,
// ..), then a barrier.
__device__ __forceinline__ void attention_prologue(int b, int g, bool writes_kv, u16* q_slot, const u16* qkv,
                                                   const u16* q_norm, const u16* k_norm, kv_t* k_cache,
                                                   kv_t* v_cache, const KvPages& pages, int p, int H, int G,
                                                   float eps, const double* inv_freq) {
  __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
  if (inv_freq) rope_table_apart(cos_s, sin_s, p, inv_freq);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const u16* row = qkv + (size_t)b * (H + 2 * G) * HEAD_DIM;
  for (int j = warp; j < GROUP + (writes_kv ? 2 : 0); j += warps) {
    const int head = j < GROUP ? g * GROUP + j : j == GROUP ? H + g : H + G + g;  // q heads, then k, then v
    const u16* src = row + head * HEAD_DIM + 4 * lane;
    if (j >= GROUP) {
      const long long at = pages.row(p) * G * HEAD_DIM + g * HEAD_DIM + 4 * lane;
      if (j == GROUP + 1) {  // v: copied as is
        store_kv4(v_cache + at, *reinterpret_cast<const uint2*>(src));
        continue;
      }
      float x[4], w[4], y[4];
      load_bf16x4(k_norm + 4 * lane, w);
      load_bf16x4(src, x);
      norm_rope_lanes(x, w, eps, inv_freq != nullptr, cos_s, sin_s, lane, y);
      store_kv4(k_cache + at, make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3])));
      continue;
    }
    float x[4], w[4], y[4];
    load_bf16x4(q_norm + 4 * lane, w);
    load_bf16x4(src, x);
    norm_rope_lanes(x, w, eps, inv_freq != nullptr, cos_s, sin_s, lane, y);
    store_bf16x4(q_slot + head * HEAD_DIM + 4 * lane, y);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");  // the K/V row: read next by this CTA's bulk copies
  __syncthreads();
}

// Whether split `split` holds the new key (at L - 1: the last active split), the one split that
// reads it this step (decode_attention.cu's split_chunk: include this after it).
__device__ __forceinline__ bool fused_qk_writes_kv(int split, int num_splits, int one_split_below, int p, int L,
                                                   int window) {
  const int n_keys = window > 0 ? min(L, window) : L;
  return p >= 0 && n_keys > 0 && split == cdiv_i(n_keys, split_chunk(n_keys, num_splits, one_split_below)) - 1;
}
