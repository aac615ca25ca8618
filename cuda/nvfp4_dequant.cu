// NVFP4 weights -> bf16, for the grouped path's large-M GEMMs (cuBLAS then reads bf16):
//   out[n][k] = bf16(E2M1(code[n][k]) * UE4M3(scale[n][k/16]) * tensor_scale[part(n)])
// computed as quant/nvfp4.py's `dequantize` does: the block value is exact, one fp32 product with
// the tensor scale, one rounding. Rows [split1, split2) use tensor_scale[1], rows from split2 on
// tensor_scale[2] (q/k/v stacked by rows, as gemv.cu). One thread per 32 weights (16 code bytes,
// two scale bytes, 64 bytes out); K % 32 == 0.
#include "nvfp4.cuh"

extern "C" __global__ void __launch_bounds__(256)
nvfp4_to_bf16(uint4* out, const uint4* codes, const u16* scales, const float* tensor_scale, int N, int K,
              int split1, int split2) {
  pdl_launch_dependents();
  const int per_row = K / 32;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)N * per_row) return;
  const int n = (int)(i / per_row);
  const uint4 q = codes[i];                   // weights: never written by a previous kernel
  const u32 s = scales[i];                    // two block-scale bytes: blocks 2c and 2c + 1
  const float ts = tensor_scale[(n >= split1) + (n >= split2)] * NVFP4_SUM_SCALE;
  const u32 block[2] = {ue4m3_scale_bf16x2(s & 0xFFu), ue4m3_scale_bf16x2(s >> 8)};
  const u32 words[4] = {q.x, q.y, q.z, q.w};
  pdl_wait();                                 // out may still be read by the previous kernel
#pragma unroll
  for (int j = 0; j < 4; ++j) {               // word j: weights 8j .. 8j + 7 of this thread's 32
    u32 p[4];                                 // p[m] = (w_m, w_{m+4}) * block scale * 2^-7
    e2m1x8_to_bf16(words[j], block[j >> 1], p);
    float w[8];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      w[m] = bf16x2_lo(p[m]) * ts;
      w[m + 4] = bf16x2_hi(p[m]) * ts;
    }
    out[4 * i + j] = make_uint4(pack_bf16x2(w[0], w[1]), pack_bf16x2(w[2], w[3]), pack_bf16x2(w[4], w[5]),
                                pack_bf16x2(w[6], w[7]));
  }
}
