// decode_attention.cu's tile with the operands swapped (ATTN_SWAP=1): the heads as the MMAs' 8
// columns instead of rows 0-7 of their 16, so no half of an MMA is zero and a tile takes 16 MMAs
// instead of 32, with half the accumulator registers.
//   S^T [16 keys x 8 heads] = K [16 keys x 128 dims] . Q^T        (A = K rows by ldmatrix, B = qa)
//   O^T [128 dims x 8 heads] += V^T [128 dims x 16 keys] . P^T      (A = V by ldmatrix.trans, B = P^T)
// Lane (g = lane / 4, t = lane % 4) holds S^T for keys g and g + 8 of heads 2t and 2t + 1, so the
// softmax of a head runs over the eight lanes of one t (shuffles 4, 8, 16), and P^T's B fragments
// (keys 2t, 2t+1 | 2t+8, 2t+9 of head g) are S^T's C fragments transposed by movmatrix.
// Q's fragments (qa, loaded by the kernel) serve as B unchanged: B[k][n = head g] is the A operand's
// row g. KV_FP8: K's k-steps take each key's dims in qa's order (a 32-bit word of 4 e4m3 = dims 4t ..
// 4t+3 feeds k pairs 2t and 2t+8 of a step, attend_tile's order); V's transposed words hold dims 2g,
// 2g+1 of keys 2t, 2t+1: a byte permute splits them, so m-tile c of O^T has rows g -> dim 16c + 2g
// and g + 8 -> dim 16c + 2g + 1 (put in order by `store`).

__device__ __forceinline__ u32 movmatrix_trans(u32 a) {
  u32 d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

struct SplitState {
  float m[2];     // running max of heads 2t, 2t + 1 (log2 domain), the same in the 8 lanes of one t
  float l[2];     // this lane's share of their running sums (keys g, g + 8 of each tile)
  float o[8][4];  // m-tile i: O^T[dim r(i, g)][2t], [r(i, g)][2t+1], [r(i, g + 8)][2t], [r(i, g + 8)][2t+1]

  __device__ __forceinline__ void init() {
    m[0] = m[1] = NEG_INF;
    l[0] = l[1] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  }

  // The warp's (m, l, o) into shared memory: cm[8], cl[8], co[8][COMBINE_STRIDE] (after the last tile).
  __device__ __forceinline__ void store(float* cm, float* cl, float* co, int lane) {
    const int t = lane & 3, g = lane >> 2;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[e] += __shfl_xor_sync(0xFFFFFFFFu, l[e], 4);
      l[e] += __shfl_xor_sync(0xFFFFFFFFu, l[e], 8);
      l[e] += __shfl_xor_sync(0xFFFFFFFFu, l[e], 16);
    }
    if (g == 0) cm[2 * t] = m[0], cm[2 * t + 1] = m[1], cl[2 * t] = l[0], cl[2 * t + 1] = l[1];
    float* h0 = co + 2 * t * COMBINE_STRIDE;
    float* h1 = h0 + COMBINE_STRIDE;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#if KV_FP8  // rows g, g + 8 of m-tile i: dims 16i + 2g, 16i + 2g + 1
      *reinterpret_cast<float2*>(h0 + 16 * i + 2 * g) = make_float2(o[i][0], o[i][2]);
      *reinterpret_cast<float2*>(h1 + 16 * i + 2 * g) = make_float2(o[i][1], o[i][3]);
#else       // rows g, g + 8 of m-tile i: dims 16i + g, 16i + g + 8
      h0[16 * i + g] = o[i][0], h1[16 * i + g] = o[i][1];
      h0[16 * i + g + 8] = o[i][2], h1[16 * i + g + 8] = o[i][3];
#endif
    }
  }
};

// One tile of 16 keys at `first_pos` (keys >= end masked) from shared memory into the state.
__device__ __forceinline__ void attend_tile(SplitState& st, const u32 (&qa)[8][2], u32 k_base, u32 v_base,
                                            int first_pos, int end, float scale_log2, int lane) {
  const int g = lane >> 2, mi = lane >> 3, r8 = lane & 7;
  // S^T: k-steps alternate between two accumulators (two chains of four MMAs), summed after.
  float s[2][4] = {};
#if KV_FP8
#pragma unroll
  for (int c2 = 0; c2 < 4; ++c2) {  // chunks 2c2, 2c2 + 1 (16 dims each) of keys 0-7 and 8-15
    u32 kw[4];                      // (keys 0-7, 2c2), (8-15, 2c2), (0-7, 2c2+1), (8-15, 2c2+1)
    ldmatrix_x4(kw, k_base + tile_offset(r8 + 8 * (mi & 1), 2 * c2 + (mi >> 1)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kk = 2 * c2 + h;
      mma_f16_16x8x16(s[h], f16x2_from_e4m3x2(kw[2 * h]), f16x2_from_e4m3x2(kw[2 * h + 1]),
                      f16x2_from_e4m3x2_hi(kw[2 * h]), f16x2_from_e4m3x2_hi(kw[2 * h + 1]), qa[kk][0], qa[kk][1]);
    }
  }
#else
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // dims 16kk .. 16kk + 15: (keys 0-7, lo 8), (8-15, lo), (0-7, hi), (8-15, hi)
    u32 ka[4];
    ldmatrix_x4(ka, k_base + tile_offset(r8 + 8 * (mi & 1), 2 * kk + (mi >> 1)));
    mma_bf16_16x8x16(s[kk & 1], ka[0], ka[1], ka[2], ka[3], qa[kk][0], qa[kk][1]);
  }
#endif
  // Online softmax of heads 2t + e over keys g (r = 0) and g + 8 (r = 1) of this lane.
  float x[2][2], p[2][2], alpha[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float tile_max = NEG_INF;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float dot = s[0][2 * r + e] + s[1][2 * r + e];
      x[r][e] = first_pos + g + 8 * r < end ? dot * scale_log2 : NEG_INF;
      tile_max = fmaxf(tile_max, x[r][e]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, 4));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, 8));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, 16));
    const float m_new = fmaxf(st.m[e], tile_max);  // finite: every tile has a valid key
    alpha[e] = exp2f(st.m[e] - m_new);             // 0 on the first tile (m = -inf)
    p[0][e] = exp2f(x[0][e] - m_new);
    p[1][e] = exp2f(x[1][e] - m_new);
    st.l[e] = st.l[e] * alpha[e] + (p[0][e] + p[1][e]);
    st.m[e] = m_new;
  }
  // P^T's B fragments: the 8 x 8 blocks (keys 0-7 | 8-15) x heads of S^T's layout, transposed.
#if KV_FP8
  const u32 pb0 = movmatrix_trans(pack_f16x2(p[0][0], p[0][1])), pb1 = movmatrix_trans(pack_f16x2(p[1][0], p[1][1]));
#pragma unroll
  for (int c2 = 0; c2 < 4; ++c2) {  // transposed words of chunks 2c2, 2c2 + 1: as kw above
    u32 vw[4];
    ldmatrix_x4_trans(vw, v_base + tile_offset(r8 + 8 * (mi & 1), 2 * c2 + (mi >> 1)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float(&o)[4] = st.o[2 * c2 + h];
      const u32 lo = prmt(vw[2 * h], 0u, 0x3120u), hi = prmt(vw[2 * h + 1], 0u, 0x3120u);  // keys 0-7, 8-15
      o[0] *= alpha[0], o[1] *= alpha[1], o[2] *= alpha[0], o[3] *= alpha[1];
      mma_f16_16x8x16(o, f16x2_from_e4m3x2(lo), f16x2_from_e4m3x2_hi(lo), f16x2_from_e4m3x2(hi),
                      f16x2_from_e4m3x2_hi(hi), pb0, pb1);
    }
  }
#else
  const u32 pb0 = movmatrix_trans(pack_bf16x2(p[0][0], p[0][1])), pb1 = movmatrix_trans(pack_bf16x2(p[1][0], p[1][1]));
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // dims 16i .. 16i + 15: (keys 0-7, lo 8), (0-7, hi), (8-15, lo), (8-15, hi)
    u32 va[4];
    ldmatrix_x4_trans(va, v_base + tile_offset(r8 + 8 * (mi >> 1), 2 * i + (mi & 1)));
    float(&o)[4] = st.o[i];
    o[0] *= alpha[0], o[1] *= alpha[1], o[2] *= alpha[0], o[3] *= alpha[1];
    mma_bf16_16x8x16(o, va[0], va[1], va[2], va[3], pb0, pb1);
  }
#endif
}
