// Greedy token choice: ids[b] = argmax_v logits[b, v], exactly as torch.argmax (ties and NaN:
// the lowest index; a NaN counts as the maximum; -0 == +0). sample_*: the same scan over
// logits[b, v] / temperature[b] + G[b, v], G Gumbel noise (the Gumbel-max trick: a draw from
// softmax(logits / temperature), the distribution of executor/sampler.py's exponential race) from
// Philox-4x32-10 keyed by rng[0], counter (v / 4, b, rng[1]); the last CTA adds 1 to rng[1], so
// each launch (and each CUDA graph replay) draws fresh noise.
// Grid (splits, B): each CTA scans `chunk` logits of one row and writes one packed candidate
//   (order_key(value) << 32) | (0xFFFFFFFF - index)      larger = better, ties -> lower index
// to `partial` [B][splits]; the last CTA to take the ticket reduces every row and resets it.
#include "argmax.cuh"

#define ARGMAX_THREADS 256

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

// Gumbel noise -log(-log u) of a 32-bit draw, u = (top 23 bits + 0.5) / 2^23 in (0, 1), exact in
// fp32 (with 24 bits, 2^24 - 0.5 rounds to 2^24: u = 1, a NaN key that wins the race, 1 draw in
// 2^24). The inner log is the accurate one: near u = 1 (e = -log u down to 6e-8) __logf's absolute
// error (~1e-7) would give e <= 0 as well.
__device__ __forceinline__ float gumbel(u32 bits) {
  const float u = ((float)(bits >> 9) + 0.5f) * 1.1920928955078125e-7f;
  return -__logf(-logf(u));
}

struct Noise {  // SAMPLE: the scan's values become f / temperature + Gumbel noise
  float inv_t;
  uint2 key;
  u32 row, off_lo, off_hi;
  __device__ __forceinline__ uint4 draws(int v4) const {  // noise bits of values 4 v4 .. 4 v4 + 3
    return philox4x32_10(make_uint4((u32)v4, row, off_lo, off_hi), key);
  }
};

// A thread's best value of its scan so far and its index: larger wins, a NaN wins over any
// number, equal values (-0 and +0 too) keep the earlier index, as argmax_candidate orders them.
struct Best {
  float f;
  int i;
  __device__ __forceinline__ void take(float v, int index) {
    const bool better = v > f || (v != v && f == f);
    f = better ? v : f;
    i = better ? index : i;
  }
  __device__ __forceinline__ u64 packed() const { return i < 0 ? 0ull : argmax_candidate(f, i); }
};

__device__ __forceinline__ u32 lane_of(const uint4& d, int j) {
  return j == 0 ? d.x : j == 1 ? d.y : j == 2 ? d.z : d.w;
}

template <bool BF16, bool SAMPLE>
__device__ __forceinline__ void argmax_rows(void* out, int out_int64, const void* logits,
                                            long long row_stride, int V, int chunk, int vec_ok,
                                            u64* partial, u32* ticket, const float* temperature = nullptr,
                                            u64* rng = nullptr, const int* active = nullptr) {
  constexpr int VEC = BF16 ? 8 : 4;  // values per 16-byte load
  __shared__ u64 warp_best[ARGMAX_THREADS / 32];
  __shared__ u32 is_last;
  pdl_launch_dependents();
  pdl_wait();
  if (active && *active == 0) return;  // no row wants the choice this time: every CTA leaves, the ticket untouched
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.y, split = blockIdx.x, splits = gridDim.x, B = gridDim.y;
  const int begin = split * chunk, end = min(V, begin + chunk);
  const u16* row16 = static_cast<const u16*>(logits) + row * row_stride;
  const float* row32 = static_cast<const float*>(logits) + row * row_stride;
  Noise noise{};
  if constexpr (SAMPLE) {
    const u64 seed = rng[0], offset = rng[1];
    noise = {1.0f / temperature[row], make_uint2((u32)seed, (u32)(seed >> 32)), (u32)row, (u32)offset,
             (u32)(offset >> 32)};
  }
  // Compared as floats in the scan and packed once at the end (a packed u64 a value was ~20 % of
  // the greedy scan's instructions); -inf with the thread's first index: a run of -inf keeps it
  const int first = begin + (int)threadIdx.x * VEC;
  Best scan{-__int_as_float(0x7F800000), first < end ? first : -1};
  for (int i = begin + threadIdx.x * VEC; i < end; i += ARGMAX_THREADS * VEC) {
    if (vec_ok && i + VEC <= end) {
      const uint4 v = BF16 ? ld_act_v4(row16 + i) : ld_act_v4(row32 + i);
      const u32 w[4] = {v.x, v.y, v.z, v.w};
      uint4 d[VEC / 4];
      if constexpr (SAMPLE) {
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) d[q] = noise.draws(i / 4 + q);  // i % 8 == 0
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float f = BF16 ? ((j & 1) ? bf16x2_hi(w[j >> 1]) : bf16x2_lo(w[j >> 1])) : __uint_as_float(w[j]);
        if constexpr (SAMPLE) f = f * noise.inv_t + gumbel(lane_of(d[j / 4], j % 4));
        scan.take(f, i + j);
      }
    } else {
      for (int j = 0; j < VEC && i + j < end; ++j) {
        float f = BF16 ? bf16_to_f32(row16[i + j]) : row32[i + j];
        if constexpr (SAMPLE) f = f * noise.inv_t + gumbel(lane_of(noise.draws((i + j) / 4), (i + j) % 4));
        scan.take(f, i + j);
      }
    }
  }
  u64 best = scan.packed();
  best = warp_max_u64(best);
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < ARGMAX_THREADS / 32; ++w) best = u64_max(best, warp_best[w]);
    partial[(size_t)row * splits + split] = best;
    is_last = ticket_arrive(ticket) == (u32)(splits * B - 1);
  }
  __syncthreads();
  if (!is_last) return;
  ticket_acquire();
  for (int r = warp; r < B; r += ARGMAX_THREADS / 32) {
    u64 m = 0;
    for (int s = lane; s < splits; s += 32) m = u64_max(m, ld_cg_u64(partial + (size_t)r * splits + s));
    m = warp_max_u64(m);
    const u32 index = 0xFFFFFFFFu - (u32)(m & 0xFFFFFFFFu);
    if (lane == 0) {
      if (out_int64)
        static_cast<long long*>(out)[r] = index;
      else
        static_cast<int*>(out)[r] = (int)index;
    }
  }
  if (threadIdx.x == 0) {
    *ticket = 0u;
    if constexpr (SAMPLE) rng[1] += 1;  // every CTA read it before taking its ticket
  }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_bf16(void* out, int out_int64, const u16* logits, long long row_stride, int V, int chunk,
            int vec_ok, u64* partial, u32* ticket, const int* active) {
  argmax_rows<true, false>(out, out_int64, logits, row_stride, V, chunk, vec_ok, partial, ticket, nullptr, nullptr,
                           active);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(void* out, int out_int64, const float* logits, long long row_stride, int V, int chunk,
           int vec_ok, u64* partial, u32* ticket, const int* active) {
  argmax_rows<false, false>(out, out_int64, logits, row_stride, V, chunk, vec_ok, partial, ticket, nullptr, nullptr,
                            active);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
sample_bf16(void* out, int out_int64, const u16* logits, long long row_stride, int V, int chunk, int vec_ok,
            u64* partial, u32* ticket, const float* temperature, u64* rng) {
  argmax_rows<true, true>(out, out_int64, logits, row_stride, V, chunk, vec_ok, partial, ticket, temperature, rng);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
sample_f32(void* out, int out_int64, const float* logits, long long row_stride, int V, int chunk, int vec_ok,
           u64* partial, u32* ticket, const float* temperature, u64* rng) {
  argmax_rows<false, true>(out, out_int64, logits, row_stride, V, chunk, vec_ok, partial, ticket, temperature, rng);
}
