// Prompt steps, per attention layer, around the prefill attention (cuda/prefill_attention*.cu):
//   prefill_qk_norm_rope_bf16   before attention: Q/K RMSNorm (+ RoPE on sliding layers) of T rows,
//                               in place in the q/k/v buffer; full layers also write each row's K
//                               (normed) and V to its paged pool row kv_rows[t]
//   prefill_kv_copy_bf16        after attention, sliding layers: K/V of rows src_rows[r] into pool
//                               rows dst_rows[r] (the ring rows of each chunk's last <= window tokens;
//                               dst_rows[r] < 0: padding, nothing)
// kv_rows[t] < 0 (padding rows of a captured step) writes no K/V.
// qkv [T, (H + 2G) * 128] bf16: q heads, then k heads, then v heads. The norm and RoPE arithmetic is
// qk_norm_rope.cuh's, shared with the decode kernel (qk_norm_rope_kv.cu), so a prompt leaves the
// same K bits in the cache as token-by-token decode does.
// KV_FP8 (a define): the pool / ring is e4m3 (attention_common.cuh): each value is stored as the
// e4m3 of the bf16 value the bf16 cache would hold (saturating at +-448).
#include "qk_norm_rope.cuh"

#define PQK_WARPS 8

// Grid (T), 256 threads: warp w handles heads w, w + 8, ...; lane l holds dims 4l .. 4l+3.
extern "C" __global__ void __launch_bounds__(PQK_WARPS * 32)
prefill_qk_norm_rope_bf16(u16* qkv, kv_t* k_pool, kv_t* v_pool, const int* kv_rows, const u16* q_norm_weight,
                          const u16* k_norm_weight, const int* positions, int num_q_heads, int num_kv_heads,
                          float eps, const double* rope_inv_freq) {
  __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
  const int row = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = num_q_heads, G = num_kv_heads;
  const bool rope = rope_inv_freq != nullptr;
  pdl_launch_dependents();
  // Before the wait: the step's metadata (copied before its first kernel) and the norm weights.
  if (rope) rope_table(cos_s, sin_s, positions[row], rope_inv_freq);
  const long long pool_row = kv_rows ? (long long)kv_rows[row] : -1;
  float wq[4], wk[4];
  {
    const uint2 a = *reinterpret_cast<const uint2*>(q_norm_weight + 4 * lane);
    const uint2 b = *reinterpret_cast<const uint2*>(k_norm_weight + 4 * lane);
    wq[0] = bf16x2_lo(a.x), wq[1] = bf16x2_hi(a.x), wq[2] = bf16x2_lo(a.y), wq[3] = bf16x2_hi(a.y);
    wk[0] = bf16x2_lo(b.x), wk[1] = bf16x2_hi(b.x), wk[2] = bf16x2_lo(b.y), wk[3] = bf16x2_hi(b.y);
  }
  __syncthreads();
  pdl_wait();
  u16* row_ptr = qkv + (long long)row * (H + 2 * G) * HEAD_DIM + 4 * lane;
  for (int head = warp; head < H + 2 * G; head += PQK_WARPS) {
    u16* p = row_ptr + head * HEAD_DIM;
    if (head >= H + G) {  // v: copied as is to the pool
      if (pool_row >= 0)
        store_kv4(v_pool + pool_row * G * HEAD_DIM + (head - H - G) * HEAD_DIM + 4 * lane,
                  *reinterpret_cast<const uint2*>(p));
      continue;
    }
    const bool is_q = head < H;
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float x[4] = {bf16x2_lo(raw.x), bf16x2_hi(raw.x), bf16x2_lo(raw.y), bf16x2_hi(raw.y)};
    const float w[4] = {is_q ? wq[0] : wk[0], is_q ? wq[1] : wk[1], is_q ? wq[2] : wk[2], is_q ? wq[3] : wk[3]};
    float y[4];
    norm_rope_lanes(x, w, eps, rope, cos_s, sin_s, lane, y);
    const uint2 out = make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
    *reinterpret_cast<uint2*>(p) = out;
    if (!is_q && pool_row >= 0) store_kv4(k_pool + pool_row * G * HEAD_DIM + (head - H) * HEAD_DIM + 4 * lane, out);
  }
}

// Grid (R), 128 threads: row r's K then V (G * 128 values each, adjacent in qkv) in pieces of 8 values
// (16 bytes read; 16 written, or 8 as e4m3).
extern "C" __global__ void __launch_bounds__(128)
prefill_kv_copy_bf16(kv_t* k_pool, kv_t* v_pool, const u16* qkv, const int* src_rows, const int* dst_rows,
                     int num_q_heads, int num_kv_heads) {
  const int r = blockIdx.x, H = num_q_heads, G = num_kv_heads, pieces = G * HEAD_DIM / 8;
  pdl_launch_dependents();
  if (dst_rows[r] < 0) return;  // padding of a captured prompt step
  const long long src = (long long)src_rows[r] * (H + 2 * G) * HEAD_DIM + H * HEAD_DIM;
  const long long dst = (long long)dst_rows[r] * G * HEAD_DIM;
  pdl_wait();  // the attention before still reads the ring rows this overwrites
  for (int i = threadIdx.x; i < 2 * pieces; i += blockDim.x) {
    const bool v = i >= pieces;
    const int c = v ? i - pieces : i;
#if KV_FP8
    const uint4 x = *reinterpret_cast<const uint4*>(qkv + src + (v ? G * HEAD_DIM : 0) + 8 * c);
    *reinterpret_cast<uint2*>((v ? v_pool : k_pool) + dst + 8 * c) =
        make_uint2(e4m3x4_from_bf16x4(make_uint2(x.x, x.y)), e4m3x4_from_bf16x4(make_uint2(x.z, x.w)));
#else
    *reinterpret_cast<uint4*>((v ? v_pool : k_pool) + dst + 8 * c) =
        *reinterpret_cast<const uint4*>(qkv + src + (v ? G * HEAD_DIM : 0) + 8 * c);
#endif
  }
}
