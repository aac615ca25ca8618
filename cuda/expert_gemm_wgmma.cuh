// The tiled expert GEMMs' main loop and epilogue on warpgroup MMAs (sm_90a): part of expert_gemm.cu,
// included there after the tile helpers it uses (decode_tile, eg_silu, the cp.async wrappers and the
// EG_* settings); see expert_gemm.cu's header for the tiles and the work list.
#pragma once

// The main loop and epilogue on warpgroup MMAs (EG_WGMMA, EG_BN 256: two warpgroups, warpgroup w
// computes tile rows 64w .. 64w + 63 against all EG_BN B rows, one m64n256k16 per k16 step; a tail
// tile of <= 64 rows leaves warpgroup 1 idle: splitting the B rows between the warpgroups instead
// (two m64n64k16 for gate/up) measured ~5 % slower for NVFP4 at 1K-8K tokens). The wgmmas of
// k-tile kt stay in flight while the next k-tile is waited for, so a stage is refilled only two
// k-tiles after its last read:
//   BF16  iteration kt loads tile kt + S - 2 into stage (kt - 2) % S, read by wgmma(kt - 2), which
//         every warpgroup finished (wgmma_wait<1> in iteration kt - 1) before this barrier.
//   NVFP4 the raw stages likewise; tile kt + 1 is decoded (one row per thread) into decoded buffer
//         (kt + 1) % 3 while wgmma(kt) reads buffer kt % 3; buffer (kt + 1) % 3 was last read by
//         wgmma(kt - 2).
//
// Swap-AB (TN > 0, EG_SWAP, items of <= TN rows): the weight tile is wgmma's A and the item's token
// rows its B, D^T[weight rows x TN tokens], so a tile of a few rows costs m64nTN instead of a whole
// m64n256 (at ~12 rows an expert -- a mixed step's 528 tokens -- the m64 tiles were 5x padding;
// removing it measured no faster alone, RESULTS.md session 11). Warpgroup wg takes two m64 slices of the weight tile: gate/up its gate
// rows 64 wg .. + 63 and the same up rows (128 + 64 wg), so SiLU.up stays in registers; down rows
// 128 wg .. + 127 (EG_WIDE: four warpgroups, one m64 slice each). Same pipeline; every warpgroup works.
template <bool GATE_UP, bool FP4, int TN, class LoadTile, class RawStage>
__device__ __forceinline__ void expert_gemm_wgmma(u16* out, unsigned char* smem, u32 base, u32 dec_base,
                                                  const u32* table, LoadTile&& load_tile, RawStage&& raw_stage,
                                                  int row0, int rows, int n0, float sum_scale_a, float sum_scale_b,
                                                  int N, int K) {
  static_assert(EG_BN == 256 && EG_THREADS == (EG_WIDE ? 512 : 256), "wgmma tiles: 2 (4) warpgroups x m64n256");
  static_assert(EG_STAGES >= (FP4 ? 4 : 3), "stages: two in use by wgmma plus the prefetch distance");
  static_assert(EG_WIDE ? TN >= 16 && TN <= 128 && FP4 : TN <= 64, "swap-AB tiles of 16 .. 64 (wide: 128) rows");
  constexpr int S = EG_STAGES;
  constexpr int STAGE_B = FP4 ? EG_BN * 36 : EG_B_BYTES;
  constexpr int STAGE = (EG_A_BYTES + STAGE_B + 1023) / 1024 * 1024;
  constexpr int ACC = TN ? TN / 2 : EG_BN / 2;  // per accumulator array (swap-AB: one per m64 slice)
  const int tid = threadIdx.x, wg = tid >> 7;
  const bool active = TN || wg * 64 < rows;  // warpgroup-uniform
  const int KT = K / EG_BK;
  // swap-AB: the first weight-tile row of the warpgroup's two m64 slices (EG_WIDE: its one slice)
  const int slice0 = EG_WIDE ? wg * 64 : GATE_UP ? wg * 64 : wg * 128;
  const int slice1 = GATE_UP ? EG_BN / 2 + wg * 64 : wg * 128 + 64;

  constexpr int ACC1 = TN && !EG_WIDE ? ACC : 1;
  float acc[ACC], acc1[ACC1];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < ACC1; ++i) acc1[i] = 0.0f;
  wgmma_fence_acc(acc);
  wgmma_fence_acc(acc1);

  auto mma_tile = [&](u32 a_tile, u32 b_tile) {
    if (!active || EG_PROBE == 2) return;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (TN == 0) {
        wgmma_m64n256k16(acc, wgmma_desc(a_tile + wg * 64 * 128 + kk * 32), wgmma_desc(b_tile + kk * 32));
      } else {
        const u64 tokens = wgmma_desc(a_tile + kk * 32);
        wgmma_ss<TN>(acc, wgmma_desc(b_tile + slice0 * 128 + kk * 32), tokens);
        if constexpr (!EG_WIDE) wgmma_ss<TN>(acc1, wgmma_desc(b_tile + slice1 * 128 + kk * 32), tokens);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < S - 2; ++s) {
    if (s < KT) load_tile(s, s);
    cp_async_commit();
  }
  if (!FP4) {
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<S - 3>();  // tile kt (committed: tiles 0 .. kt + S - 3)
      fence_proxy_async_shared();
      __syncthreads();
      if (kt + S - 2 < KT) load_tile(kt + S - 2, (kt + S - 2) % S);
      cp_async_commit();
      const u32 sa = base + (kt % S) * STAGE;
      mma_tile(sa, sa + EG_A_BYTES);
      wgmma_commit();
      wgmma_wait<1>();
    }
  } else {
    cp_async_wait<S - 3>();
    __syncthreads();  // the scale table, tile 0's raw bytes
    decode_tile(dec_base, raw_stage(0), table, tid);
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<S - 4>();  // tile kt + 1
      fence_proxy_async_shared();  // this thread's decoded rows and copied A chunks, to wgmma
      __syncthreads();
      if (kt + S - 2 < KT) load_tile(kt + S - 2, (kt + S - 2) % S);
      cp_async_commit();
      const u32 sa = base + (kt % S) * STAGE;
      mma_tile(sa, dec_base + (kt % 3) * EG_B_BYTES);
      wgmma_commit();
      if (kt + 1 < KT) decode_tile(dec_base + ((kt + 1) % 3) * EG_B_BYTES, raw_stage((kt + 1) % S), table, tid);
      wgmma_wait<1>();
    }
  }
  cp_async_wait<0>();
  wgmma_wait<0>();
  wgmma_fence_acc(acc);
  wgmma_fence_acc(acc1);
  if (!active) return;

  // Thread (warp w of the warpgroup, lane 4g + q): rows 64 wg + 16 w + g (+ 8), columns 8j + 2q (+ 1).
  const int lane = tid & 31, g = lane >> 2, q = lane & 3;
  if constexpr (TN > 0) {  // rows of D are weight rows (output columns), its columns the item's tokens
    const int w = (tid >> 5) & 3;
#pragma unroll
    for (int j = 0; j < TN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 8 * j + 2 * q + e;
        if (t >= rows) continue;
        u16* orow = out + (size_t)(row0 + t) * N + n0;
        if constexpr (EG_WIDE && GATE_UP) {  // rows g (gate) and g + 8 (up) of column 32 wg + 8 w + g
          orow[32 * wg + 8 * w + g] =
              f32_to_bf16(eg_silu(acc[4 * j + e] * sum_scale_a) * (acc[4 * j + 2 + e] * sum_scale_b));
          continue;
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half + e, f = 16 * w + g + 8 * half;
          if constexpr (GATE_UP) {
            orow[slice0 + f] = f32_to_bf16(eg_silu(acc[i] * sum_scale_a) * (acc1[i] * sum_scale_b));
          } else {
            orow[slice0 + f] = f32_to_bf16(acc[i] * sum_scale_a);
            if constexpr (!EG_WIDE) orow[slice1 + f] = f32_to_bf16(acc1[i] * sum_scale_a);
          }
        }
      }
    return;
  }
  if constexpr (TN == 0) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wg * 64 + ((tid >> 5) & 3) * 16 + g + 8 * half;
    if (r >= rows) continue;
    u16* orow = out + (size_t)(row0 + r) * N;
    if (GATE_UP) {
#pragma unroll
      for (int j = 0; j < EG_BN / 16; ++j) {  // gate block j, up block j + EG_BN / 16
        const float* ga = &acc[4 * j + 2 * half];
        const float* ua = &acc[4 * (j + EG_BN / 16) + 2 * half];
        const float h0 = eg_silu(ga[0] * sum_scale_a) * (ua[0] * sum_scale_b);
        const float h1 = eg_silu(ga[1] * sum_scale_a) * (ua[1] * sum_scale_b);
        *reinterpret_cast<u32*>(orow + n0 + 8 * j + 2 * q) = pack_bf16x2(h0, h1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < EG_BN / 8; ++j)
        *reinterpret_cast<u32*>(orow + n0 + 8 * j + 2 * q) =
            pack_bf16x2(acc[4 * j + 2 * half] * sum_scale_a, acc[4 * j + 2 * half + 1] * sum_scale_a);
    }
  }
  }
}
