// decode_attention.cu's kernel with the Q/K norm operation inside (kernels/attention.py
// decode_attention_qk; executor/kernel_ops.py FUSE_QK_ATTENTION): the same defines.
#include "decode_attention.cu"
#include "attention_prologue.cuh"

// decode_attention_bf16 after the Q/K norm + RoPE + K/V write of its KV head (qk_norm_rope_kv's
// arithmetic, the same bits), so the kernel before it is the q/k/v projection itself: each CTA
// normalizes its 8 query heads into its own slot of q_slots [grid][H][128] (the same for every
// split of a head; a split's own slot keeps CTAs from writing what others read), and the split that
// holds the new key writes the K/V row. inv_freq: the RoPE table (sliding layers), else null.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
decode_attention_qk_bf16(u16* out, u16* q_slots, const u16* qkv, const u16* q_norm, const u16* k_norm,
                         const int* positions, const double* inv_freq, float eps, kv_t* k_cache, kv_t* v_cache,
                         const int* block_tables, int table_stride, const int* ring_slots, int page_rows, int window,
                         const int* seq_lens, int one_split_below, const void* sinks, int sinks_bf16,
                         float scale_log2, u32* tickets, float* partials) {
  const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z, G = gridDim.y, H = GROUP * G;
  u16* q = q_slots + ((size_t)(b * G + g) * gridDim.x + split) * H * HEAD_DIM;
  const int p = positions[b], L = max(0, seq_lens[b]);  // the step's inputs: written before its first kernel
  const bool writes_kv = fused_qk_writes_kv(split, gridDim.x, one_split_below, p, L, window);
  pdl_wait();  // qkv: the kernel before's
  attention_prologue(b, g, writes_kv, q, qkv, q_norm, k_norm, k_cache, v_cache,
                     KvPages(block_tables, table_stride, ring_slots, page_rows, b), max(p, 0), H, G, eps, inv_freq);
  decode_attention_cta(split, g, b, gridDim.x, G, out, q, 0, k_cache, v_cache, block_tables, table_stride, ring_slots,
                       page_rows, window, seq_lens, one_split_below, sinks, sinks_bf16, scale_log2, tickets, partials);
}
