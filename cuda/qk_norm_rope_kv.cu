// Decode step, per attention layer: Q/K RMSNorm + RoPE + KV-cache write, one launch.
//   qkv [B, (H + 2G) * 128] bf16: q heads, then k heads, then v heads (the fused projection).
//   q_out[b, h] = rope(bf16(rms_norm(q)))           written for every request
//   K row       = rope(bf16(rms_norm(k))), V row = v  written at positions[b] (skipped when < 0)
// Rounding follows model/reference.py step by step: the norm result is rounded to bf16, RoPE reads
// that bf16 value, and cos/sin come from fp64 angles rounded to fp32, so at any position (up to
// 2^31) the output matches `apply_rope(rms_norm(x))` up to the fp32 sum order in the norm.
// rope_inv_freq [64] fp64 (theta^(-2i/128), attention.py builds it); null disables RoPE (full layers).
// Grid (B, ceil((H + 2G) / 8)), 256 threads: one warp per head, lane l holds dims 4l..4l+3.
// KV_FP8: the cache is e4m3 (attention_common.cuh): the K row is the bf16 value above, rounded again.
#include "qk_norm_rope.cuh"

#ifndef QKN_WARPS
#define QKN_WARPS 8  // a define: cuda/decode_step.cu builds it on its CTA's warps
#endif

// One CTA: request b, heads head_block * QKN_WARPS .. + QKN_WARPS - 1.
__device__ __forceinline__ void qk_norm_rope_kv_cta(int b, int head_block, u16* q_out, kv_t* k_cache, kv_t* v_cache,
                                                    const u16* qkv, const u16* q_norm_weight, const u16* k_norm_weight,
                                                    const int* positions, const int* block_tables, int table_stride,
                                                    const int* ring_slots, int page_rows, int num_q_heads,
                                                    int num_kv_heads, float eps, const double* rope_inv_freq) {
  __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = num_q_heads, G = num_kv_heads, head = head_block * QKN_WARPS + warp;
  const bool rope = rope_inv_freq != nullptr;
  pdl_launch_dependents();
  // Before the wait: positions, block tables and ring slots are the step's inputs (written before
  // its first kernel, which did not use PDL), the norm weights are weights. Only qkv comes from
  // the kernel before.
  const int p = positions[b];
  if (rope) rope_table(cos_s, sin_s, p, rope_inv_freq);
  __syncthreads();
  if (head >= H + 2 * G) return;

  const u16* src = qkv + (long long)b * (H + 2 * G) * HEAD_DIM + head * HEAD_DIM + 4 * lane;
  const long long kv_offset =
      p >= 0 ? KvPages(block_tables, table_stride, ring_slots, page_rows, b).row(p) * G * HEAD_DIM : 0;
  const bool is_q = head < H;
  float x[4], w[4];
  if (head < H + G) load_bf16x4((is_q ? q_norm_weight : k_norm_weight) + 4 * lane, w);
  pdl_wait();
  if (head >= H + G) {  // v: copied as is
    if (p >= 0)
      store_kv4(v_cache + kv_offset + (head - H - G) * HEAD_DIM + 4 * lane, *reinterpret_cast<const uint2*>(src));
    return;
  }
  load_bf16x4(src, x);
  float y[4];
  norm_rope_lanes(x, w, eps, rope, cos_s, sin_s, lane, y);
  if (is_q)
    store_bf16x4(q_out + ((long long)b * H + head) * HEAD_DIM + 4 * lane, y);
  else if (p >= 0)
    store_kv4(k_cache + kv_offset + (head - H) * HEAD_DIM + 4 * lane,
              make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3])));
}

extern "C" __global__ void __launch_bounds__(QKN_WARPS * 32)
qk_norm_rope_kv_bf16(u16* q_out, kv_t* k_cache, kv_t* v_cache, const u16* qkv, const u16* q_norm_weight,
                     const u16* k_norm_weight, const int* positions, const int* block_tables,
                     int table_stride, const int* ring_slots, int page_rows, int num_q_heads,
                     int num_kv_heads, float eps, const double* rope_inv_freq) {
  qk_norm_rope_kv_cta(blockIdx.x, blockIdx.y, q_out, k_cache, v_cache, qkv, q_norm_weight, k_norm_weight, positions,
                      block_tables, table_stride, ring_slots, page_rows, num_q_heads, num_kv_heads, eps,
                      rope_inv_freq);
}
