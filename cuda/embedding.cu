// A step's first kernel: the token embedding lookup, with a decode step's input bookkeeping folded in.
//
//   embed_tokens: row r's token is sampled[sources[r]] where sources[r] >= 0 (a placeholder: the
//                 previous step's sampled token, on the device), else tokens[r]; out[r] = table[token]
//                 (bf16 rows of H values; a token outside [0, V) gives a zero row). With a block-table
//                 scatter (table_index non-null), thread 0 of CTA r also writes
//                 block_tables[table_index[r]] = table_value[r] (the entry row r's request gained).
// One CTA per row, 16 bytes a thread (H % 8 == 0). tokens: int32, or int64 with tokens_i64 (a
// prompt step's ids); sources, sampled, table_index, table_value: int32, or null.
#include "common.cuh"

#define EMBED_THREADS 256

extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_tokens(u16* out, const u16* table, const void* tokens, int tokens_i64, const int* sources, const int* sampled,
             const int* table_index, const int* table_value, int* block_tables, int V, int H) {
  pdl_launch_dependents();
  pdl_wait();
  const int r = blockIdx.x;
  if (table_index && threadIdx.x == 0) block_tables[table_index[r]] = table_value[r];
  const int source = sources ? sources[r] : -1;
  const long long token = source >= 0   ? (long long)sampled[source]
                          : tokens_i64 ? static_cast<const long long*>(tokens)[r]
                                       : (long long)static_cast<const int*>(tokens)[r];
  const bool valid = 0 <= token && token < V;
  const uint4* src = reinterpret_cast<const uint4*>(table + (valid ? token : 0) * H);
  uint4* dst = reinterpret_cast<uint4*>(out + (long long)r * H);
  for (int i = threadIdx.x; i < H / 8; i += EMBED_THREADS) dst[i] = valid ? src[i] : make_uint4(0u, 0u, 0u, 0u);
}
