// A decode step's layers in one launch (issue 17's persistent decode; the fused path's <= 8 rows).
// One CTA of STEP_WARPS warps (8: one CTA a SM; 4: two) walks its own list of tasks; a task is a
// range of tiles of one operation of one layer, run by the graph path's kernel bodies with the
// tile as an argument (gemv.cu, qk_norm_rope_kv.cu, decode_attention.cu, rmsnorm.cu, router.cu,
// moe.cu):
//
//   layer i:  norm_in -> qkv -> qk_norm -> attention -> o_proj (+ h) -> norm_post
//             -> router -> gate_up -> down (+ h)              MoE layers
//             -> dense_gate_up -> dense_down (+ h)             dense layers
//
// Each (layer, operation) has a counter; a task bumps its operation's counter once when done (a
// release add after the CTA's barrier) and waits, before it starts, until the operation before it has
// as many bumps as it has tasks (thread 0 polls, then a fence acquires; the CTA passes a barrier).
// While it waits its CTA has already asked L2 for the task's weights (the task before asks for the
// next one's), which is what PDL's early weight loads did at a kernel boundary. The host builds the
// lists (kernels/decode_step.py): each CTA's in operation order, all CTAs resident at once, so the
// tasks that finish an operation can always run: no deadlock, no grid barrier. The last CTA to
// finish zeroes the counters for the next launch (graph replays).
//
// The rows are hidden[0] of the fused path: read and written in place by the residual operations
// (each element by one thread). Attention runs on warps 0-3 (a named barrier; decode_attention.cu
// is a 4-warp body); with 8 warps a CTA, warps 4-7 wait at the task's end.
//
// SI_FOLD_NORMS: no norm operations; each task of an operation that reads a normed row (q/k/v, the
// router, gate/up) first normalizes the rows itself into its CTA's slot of x (rmsnorm.cu's body,
// so the same bits), two dependent hops a layer fewer for B x 4 KB read again per task.
// STEP_FUSE_QK (a build of its own): no qk_norm operation; each attention task normalizes (sliding
// layers: and rotates) its KV head's 8 query heads itself into its CTA's q slot, and the task of
// the split that holds the new key writes that head's K/V row first (only that split reads it this
// step). The arithmetic is qk_norm_rope_kv.cu's (norm_rope_lanes): the same bits, one dependent hop
// a layer fewer. (Every build sits at the 255 registers a thread; ptxas spills 0-30 bytes in some
// and not in others as unrelated lines move: tests/test_decode_step.py bounds it.)
// A non-null `trace` gets three global-timer stamps a task (before its wait, after it, after its
// bump): benchmarks/bench_decode_step.py charges each operation with them.
// Defines (kernels/decode_step.py): STEP_WARPS, STEP_FUSE_QK, X_BATCH (gemv_tile.cuh), KV_FP8,
// ATTN_STAGES, ATTN_CP_ASYNC, ATTN_MIN_SPLIT_KEYS (decode_attention.cu).
#define PERSISTENT_STEP 1
#ifndef STEP_FUSE_QK
#define STEP_FUSE_QK 0
#endif
#ifndef STEP_WARPS
#define STEP_WARPS 8
#endif
#define STEP_THREADS (STEP_WARPS * 32)
#define GEMV_WARPS STEP_WARPS
#define GEMV_GROUPS 1
#define MOE_GATE_UP_WARPS STEP_WARPS
#define MOE_DOWN_WARPS STEP_WARPS
#define ROUTER_WARPS STEP_WARPS
#define QKN_WARPS STEP_WARPS
#define ATTN_SYNC() asm volatile("bar.sync 1, 128;" ::: "memory")
#include "gemv.cu"
#include "moe.cu"
#include "router.cu"
#include "rmsnorm.cu"
#include "qk_norm_rope_kv.cu"
#include "decode_attention.cu"

// kernels/decode_step.py mirrors these four lists by name (tests/test_decode_step.py checks).
enum StepOp {
  OP_NORM_IN, OP_QKV, OP_QK_NORM, OP_ATTENTION, OP_O_PROJ, OP_NORM_POST, OP_ROUTER, OP_GATE_UP, OP_DOWN,
  OP_DENSE_GATE_UP, OP_DENSE_DOWN,
};

enum StepPtr {  // the step's buffers
  SP_H, SP_X, SP_QKV, SP_Q, SP_ATTN, SP_ROUTER_PARTIAL, SP_ROUTER_TICKET, SP_IDS, SP_ROUTE_WEIGHTS, SP_MOE_H,
  SP_DENSE_H, SP_POSITIONS, SP_SEQ_LENS, SP_RING_SLOTS, SP_BLOCK_TABLES, SP_ATTN_TICKETS, SP_ATTN_PARTIALS,
  SP_ROPE_INV_FREQ, SP_LAYERS, SP_COUNT,
};

enum StepInt {  // the step's sizes (floats as their bits)
  SI_ROWS, SI_HIDDEN, SI_HEADS, SI_KV_HEADS, SI_MOE_I, SI_DENSE_I, SI_EXPERTS, SI_TOP_K, SI_ROUTER_SPLITS,
  SI_SPLITS_SLIDING, SI_SPLITS_FULL, SI_ONE_SPLIT_SLIDING, SI_ONE_SPLIT_FULL, SI_TABLE_STRIDE, SI_BLOCK_SIZE,
  SI_RING_ROWS, SI_WINDOW, SI_SINKS_BF16, SI_HAS_SHARED, SI_EPS, SI_SCALING, SI_SCALE_LOG2, SI_FOLD_NORMS,
  SI_EARLY_WEIGHTS, SI_COUNT,
};

enum LayerPtr {  // per layer; a weight is 3 entries: NVFP4 (codes, scales, tensor scale), bf16 (w, 0, 0)
  LP_IN_NORM, LP_POST_NORM, LP_QKV, LP_QKV_1, LP_QKV_2, LP_Q_NORM, LP_K_NORM, LP_SINKS, LP_K_POOL, LP_V_POOL,
  LP_O, LP_O_1, LP_O_2, LP_ROUTER, LP_ROUTER_BIAS, LP_GATE, LP_GATE_1, LP_GATE_2, LP_UP, LP_UP_1, LP_UP_2,
  LP_DOWN, LP_DOWN_1, LP_DOWN_2, LP_SHARED_GATE, LP_SHARED_GATE_1, LP_SHARED_GATE_2, LP_SHARED_UP,
  LP_SHARED_UP_1, LP_SHARED_UP_2, LP_SHARED_DOWN, LP_SHARED_DOWN_1, LP_SHARED_DOWN_2, LP_QKV_SPLIT1,
  LP_QKV_SPLIT2, LP_SLIDING, LP_COUNT,
};

struct StepTask {
  int op, layer, begin, end;  // tiles [begin, end) of the operation
  int wait, target;           // start once counters[wait] >= target (wait < 0: at once)
  int signal, pad;            // then counters[signal] += 1
};

template <class Wt>
__device__ __forceinline__ Wt weight_at(const u64* p);
template <>
__device__ __forceinline__ Nvfp4Weights weight_at<Nvfp4Weights>(const u64* p) {
  return {reinterpret_cast<const u8*>(p[0]), reinterpret_cast<const u8*>(p[1]), reinterpret_cast<const float*>(p[2])};
}
template <>
__device__ __forceinline__ Bf16Weights weight_at<Bf16Weights>(const u64* p) {
  return {reinterpret_cast<const u16*>(p[0])};
}

template <class T>
__device__ __forceinline__ T* ptr(const u64* table, int i) {
  return reinterpret_cast<T*>(table[i]);
}

__device__ __forceinline__ float as_float(int bits) { return __int_as_float(bits); }

// L2 prefetch of the weights task t reads (by thread 0, before it waits): rows [16 begin, 16 end)
// of a GEMV's weight, cut at its N rows.
template <class Wt>
__device__ __forceinline__ void prefetch_rows(const Wt& w, int first, int end, int n, int k) {
  end = min(end, n);
  if (first < end) w.prefetch(first, end - first, k);
}

// NOTE: __noinline__ (and prefetch_down): inlined into the task loop they pushed the kernel past
// the 255 registers a thread and it spilled (ptxas, both formats).
template <class Wt>
__device__ __noinline__ void prefetch_task(const StepTask& t, const u64* sp, const int* si) {
  const u64* lp = ptr<const u64>(sp, SP_LAYERS) + (size_t)t.layer * LP_COUNT;
  const int hidden = si[SI_HIDDEN], heads = si[SI_HEADS], dense = si[SI_DENSE_I];
  switch (t.op) {
    case OP_QKV:
      prefetch_rows(weight_at<Wt>(lp + LP_QKV), 16 * t.begin, 16 * t.end, (heads + 2 * si[SI_KV_HEADS]) * HEAD_DIM,
                    hidden);
      break;
    case OP_O_PROJ:
      prefetch_rows(weight_at<Wt>(lp + LP_O), 16 * t.begin, 16 * t.end, hidden, heads * HEAD_DIM);
      break;
    case OP_ROUTER: {
      const int splits = si[SI_ROUTER_SPLITS];
      prefetch_rows(weight_at<Bf16Weights>(lp + LP_ROUTER), 16 * (t.begin / splits), 16 * ((t.end - 1) / splits + 1),
                    si[SI_EXPERTS], hidden);
      break;
    }
    case OP_DENSE_GATE_UP:
      prefetch_rows(weight_at<Wt>(lp + LP_GATE), 8 * t.begin, 8 * t.end, dense, hidden);
      prefetch_rows(weight_at<Wt>(lp + LP_UP), 8 * t.begin, 8 * t.end, dense, hidden);
      break;
    case OP_DENSE_DOWN:
      prefetch_rows(weight_at<Wt>(lp + LP_DOWN), 16 * t.begin, 16 * t.end, hidden, dense);
      break;
    default:  // norms, attention (KV rows), the experts (known once routed)
      break;
  }
}

#if STEP_FUSE_QK
#include "attention_prologue.cuh"
#endif

// Tile i of operation op of layer `layer`: one CTA's worth of the kernel the graph path launches.
// x: the normed rows this CTA reads (SP_X, or its own slot of it with SI_FOLD_NORMS); q: the query
// heads attention reads (SP_Q [B][H][128], or with STEP_FUSE_QK this CTA's slot [H][128] of it).
template <class Wt, int U>
__device__ __forceinline__ void run_tile(int op, int layer, int i, const u64* sp, const int* si, u16* x, u16* q) {
  const u64* lp = ptr<const u64>(sp, SP_LAYERS) + (size_t)layer * LP_COUNT;
  const int B = si[SI_ROWS], hidden = si[SI_HIDDEN], H = si[SI_HEADS], G = si[SI_KV_HEADS];
  const int qkv_rows = (H + 2 * G) * HEAD_DIM;
  const float eps = as_float(si[SI_EPS]);
  u16* h = ptr<u16>(sp, SP_H);
  switch (op) {
    case OP_NORM_IN:
    case OP_NORM_POST:
      add_norm_row<u16>(i, B, x, nullptr, h, nullptr, ptr<const u16>(lp, op == OP_NORM_IN ? LP_IN_NORM : LP_POST_NORM),
                        hidden, eps);
      break;
    case OP_QKV:
      gemv<Wt, U>(i, ptr<u16>(sp, SP_QKV), x, weight_at<Wt>(lp + LP_QKV), nullptr, B, qkv_rows, hidden,
                  (int)lp[LP_QKV_SPLIT1], (int)lp[LP_QKV_SPLIT2]);
      break;
    case OP_QK_NORM: {
      const int blocks = cdiv_i(H + 2 * G, QKN_WARPS);
      const bool sliding = lp[LP_SLIDING] != 0;
      qk_norm_rope_kv_cta(i / blocks, i % blocks, q, ptr<kv_t>(lp, LP_K_POOL), ptr<kv_t>(lp, LP_V_POOL),
                          ptr<const u16>(sp, SP_QKV), ptr<const u16>(lp, LP_Q_NORM), ptr<const u16>(lp, LP_K_NORM),
                          ptr<const int>(sp, SP_POSITIONS), sliding ? nullptr : ptr<const int>(sp, SP_BLOCK_TABLES),
                          si[SI_TABLE_STRIDE], ptr<const int>(sp, SP_RING_SLOTS),
                          sliding ? si[SI_RING_ROWS] : si[SI_BLOCK_SIZE], H, G, eps,
                          sliding ? ptr<const double>(sp, SP_ROPE_INV_FREQ) : nullptr);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the K/V rows: read next by bulk copies
      break;
    }
    case OP_ATTENTION: {
      const bool sliding = lp[LP_SLIDING] != 0;
      const int splits = sliding ? si[SI_SPLITS_SLIDING] : si[SI_SPLITS_FULL];
      const int pair = i / splits, b = pair / G, g = pair % G, split = i % splits;
      const int one_split = sliding ? si[SI_ONE_SPLIT_SLIDING] : si[SI_ONE_SPLIT_FULL];
#if STEP_FUSE_QK  // the split holding the new key writes it
      const int p = ptr<const int>(sp, SP_POSITIONS)[b], L = max(0, ptr<const int>(sp, SP_SEQ_LENS)[b]);
      const bool writes_kv = fused_qk_writes_kv(split, splits, one_split, p, L, sliding ? si[SI_WINDOW] : 0);
      const KvPages pages(sliding ? nullptr : ptr<const int>(sp, SP_BLOCK_TABLES), si[SI_TABLE_STRIDE],
                          ptr<const int>(sp, SP_RING_SLOTS), sliding ? si[SI_RING_ROWS] : si[SI_BLOCK_SIZE], b);
      attention_prologue(b, g, writes_kv, q, ptr<const u16>(sp, SP_QKV), ptr<const u16>(lp, LP_Q_NORM),
                         ptr<const u16>(lp, LP_K_NORM), ptr<kv_t>(lp, LP_K_POOL), ptr<kv_t>(lp, LP_V_POOL), pages,
                         max(p, 0), H, G, eps, sliding ? ptr<const double>(sp, SP_ROPE_INV_FREQ) : nullptr);
      const int q_stride = 0;
#else
      const int q_stride = H * HEAD_DIM;
#endif
      if (threadIdx.x >= ATTN_THREADS) break;
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the new K/V rows, written by other tasks
      decode_attention_cta(split, g, b, splits, G, ptr<u16>(sp, SP_ATTN), q, q_stride,
                           ptr<const kv_t>(lp, LP_K_POOL), ptr<const kv_t>(lp, LP_V_POOL),
                           sliding ? nullptr : ptr<const int>(sp, SP_BLOCK_TABLES),
                           sliding ? 0 : si[SI_TABLE_STRIDE], ptr<const int>(sp, SP_RING_SLOTS),
                           sliding ? si[SI_RING_ROWS] : si[SI_BLOCK_SIZE], sliding ? si[SI_WINDOW] : 0,
                           ptr<const int>(sp, SP_SEQ_LENS), one_split,
                           ptr<const void>(lp, LP_SINKS), si[SI_SINKS_BF16], as_float(si[SI_SCALE_LOG2]),
                           ptr<u32>(sp, SP_ATTN_TICKETS), ptr<float>(sp, SP_ATTN_PARTIALS));
      break;
    }
    case OP_O_PROJ:
      gemv<Wt, U>(i, h, ptr<const u16>(sp, SP_ATTN), weight_at<Wt>(lp + LP_O), h, B, hidden, H * HEAD_DIM, hidden,
                  hidden);
      break;
    case OP_ROUTER: {
      const int splits = si[SI_ROUTER_SPLITS], E = si[SI_EXPERTS];
      router_topk_cta(i / splits, i % splits, splits, cdiv_i(E, 16) * splits, ptr<int>(sp, SP_IDS),
                      ptr<float>(sp, SP_ROUTE_WEIGHTS), x, ptr<const u16>(lp, LP_ROUTER),
                      ptr<const float>(lp, LP_ROUTER_BIAS), ptr<float>(sp, SP_ROUTER_PARTIAL),
                      ptr<u32>(sp, SP_ROUTER_TICKET), B, E, hidden, si[SI_TOP_K], as_float(si[SI_SCALING]));
      break;
    }
    case OP_GATE_UP: {
      const int I = si[SI_MOE_I], tiles = cdiv_i(I, 8);
      moe_gate_up<Wt, U>(i % tiles, i / tiles, ptr<u16>(sp, SP_MOE_H), x, ptr<const int>(sp, SP_IDS),
                         weight_at<Wt>(lp + LP_GATE), weight_at<Wt>(lp + LP_UP), weight_at<Wt>(lp + LP_SHARED_GATE),
                         weight_at<Wt>(lp + LP_SHARED_UP), B, si[SI_TOP_K], I, hidden, si[SI_EXPERTS]);
      break;
    }
    case OP_DOWN:
      moe_down<Wt, U>(i, h, ptr<const u16>(sp, SP_MOE_H), ptr<const int>(sp, SP_IDS),
                      ptr<const float>(sp, SP_ROUTE_WEIGHTS), weight_at<Wt>(lp + LP_DOWN),
                      weight_at<Wt>(lp + LP_SHARED_DOWN), si[SI_HAS_SHARED], h, B, si[SI_TOP_K], hidden,
                      si[SI_MOE_I], si[SI_EXPERTS]);
      break;
    case OP_DENSE_GATE_UP:
      gate_up<Wt, U>(i, ptr<u16>(sp, SP_DENSE_H), x, weight_at<Wt>(lp + LP_GATE), weight_at<Wt>(lp + LP_UP), B,
                     si[SI_DENSE_I], hidden);
      break;
    case OP_DENSE_DOWN:
      gemv<Wt, U>(i, h, ptr<const u16>(sp, SP_DENSE_H), weight_at<Wt>(lp + LP_DOWN), h, B, hidden, si[SI_DENSE_I],
                  hidden, hidden);
      break;
  }
}

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Spin until *counter >= target, then acquire (a relaxed poll and one fence: an acquire load a poll
// would also drop the SM's L1, which a second CTA on the SM may be reading from). A wait of over
// STEP_WAIT_LIMIT_NS traps: a plan or kernel bug (or a CTA that never became resident) ends the
// launch with an error, not a hung GPU.
#define STEP_WAIT_LIMIT_NS 2000000000ull
__device__ __forceinline__ void wait_for(const int* counter, int target) {
  if (ld_relaxed_gpu(counter) < target) {
    const u64 start = global_ns();
    while (ld_relaxed_gpu(counter) < target)
      if (global_ns() - start > STEP_WAIT_LIMIT_NS) __trap();
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// The wait a task defers into its body (SI_EARLY_WEIGHTS): set by thread 0 before the task's
// barrier, read by `step_wait` (common.cuh's `pdl_wait` in this build) wherever the body calls it,
// after its weights' first loads. The first active lane of each calling warp polls and fences;
// its warp follows. Null: nothing to wait for (waited in the loop, or already by an earlier tile).
__shared__ const int* step_wait_counter;
__shared__ int step_wait_target;
__shared__ u64* step_wait_stamp;  // the trace's "waited" stamp of the task, or null

__device__ __forceinline__ void step_wait() {
  const int* counter = step_wait_counter;
  if (counter == nullptr) return;
  const unsigned active = __activemask();
  if ((threadIdx.x & 31) == __ffs(active) - 1) {
    wait_for(counter, step_wait_target);
    u64* stamp = step_wait_stamp;
    if (stamp && threadIdx.x < 32) *stamp = global_ns();
  }
  __syncwarp(active);
}

// Whether task op's body may wait where it calls pdl_wait: everything it touches before that is
// weights, shared memory, or the step's inputs and earlier steps' K/V. Not expert down: it reads the
// routed ids before its wait (a kernel boundary after gate/up's wait makes that safe there, a CTA's
// previous task here need not be gate/up); not gate/up (its body waits before anything, and the
// loop's prefetch_down reads the ids); not a task that first normalizes its rows (SI_FOLD_NORMS) or
// writes K/V (STEP_FUSE_QK attention).
__device__ __forceinline__ bool defers_wait(int op, bool folded) {
  if (folded || op == OP_DOWN || op == OP_GATE_UP) return false;  // gate/up: waits first thing anyway
  return !(STEP_FUSE_QK && op == OP_ATTENTION);
}

// A gate/up task's CTA, its wait passed (the ids are routed), asks L2 for the rows its next task,
// a down task, reads of each chosen expert and the shared one: warp 0, a lane a (row, slot) pair.
template <class Wt>
__device__ __noinline__ void prefetch_down(const StepTask& next, const u64* sp, const int* si) {
  const u64* lp = ptr<const u64>(sp, SP_LAYERS) + (size_t)next.layer * LP_COUNT;
  const int pairs = si[SI_ROWS] * si[SI_TOP_K], lane = threadIdx.x & 31;
  const int hidden = si[SI_HIDDEN], I = si[SI_MOE_I], E = si[SI_EXPERTS];
  for (int q = lane; q <= pairs; q += 32) {
    if (q == pairs) {
      if (si[SI_HAS_SHARED]) prefetch_rows(weight_at<Wt>(lp + LP_SHARED_DOWN), 16 * next.begin, 16 * next.end, hidden, I);
      continue;
    }
    const int e = __ldcg(ptr<const int>(sp, SP_IDS) + q);
    if (e >= 0 && e < E)
      prefetch_rows(weight_at<Wt>(lp + LP_DOWN).expert(e, hidden, I), 16 * next.begin, 16 * next.end, hidden, I);
  }
}

// The next task of this CTA's list from k + 1 on whose weights are known before its wait (the
// first two looked at: a norm or Q/K-norm task between two GEMVs is passed over), or -1.
__device__ __forceinline__ int next_prefetch(const StepTask* tasks, int k, int last) {
  for (int j = k + 1; j < min(last, k + 3); ++j) {
    const int op = tasks[j].op;
    if (op == OP_QKV || op == OP_O_PROJ || op == OP_ROUTER || op == OP_DENSE_GATE_UP || op == OP_DENSE_DOWN) return j;
  }
  return -1;
}

// The norm an operation's input is (SI_FOLD_NORMS: its tasks compute it), or null.
__device__ __forceinline__ const u16* folded_norm(int op, const u64* lp) {
  switch (op) {
    case OP_QKV: return ptr<const u16>(lp, LP_IN_NORM);
    case OP_ROUTER: case OP_GATE_UP: case OP_DENSE_GATE_UP: return ptr<const u16>(lp, LP_POST_NORM);
    default: return nullptr;
  }
}

template <class Wt, int U>
__device__ __forceinline__ void decode_step(const StepTask* tasks, const int* task_start, int* counters,
                                            int num_counters, const u64* step_ptrs, const int* step_ints,
                                            u64* trace) {
  __shared__ u64 sp[SP_COUNT];
  __shared__ int si[SI_COUNT];
  __shared__ int last_out;
  for (int j = threadIdx.x; j < SP_COUNT; j += blockDim.x) sp[j] = step_ptrs[j];
  for (int j = threadIdx.x; j < SI_COUNT; j += blockDim.x) si[j] = step_ints[j];
  __syncthreads();
  const int first = task_start[blockIdx.x], last = task_start[blockIdx.x + 1];
  const bool fold = si[SI_FOLD_NORMS] != 0;
  u16* const x = ptr<u16>(sp, SP_X) + (fold ? (size_t)blockIdx.x * si[SI_ROWS] * si[SI_HIDDEN] : 0);
  u16* const q = ptr<u16>(sp, SP_Q) + (STEP_FUSE_QK ? (size_t)blockIdx.x * si[SI_HEADS] * HEAD_DIM : 0);
  if (threadIdx.x == 0 && first < last) prefetch_task<Wt>(tasks[first], sp, si);
  griddep_wait();  // the kernel before (the embedding: h, new block-table entries) is complete
  const bool early = si[SI_EARLY_WEIGHTS] != 0;
  int prefetched = first;  // thread 0: the last task whose weights were asked for
  for (int k = first; k < last; ++k) {
    const StepTask t = tasks[k];
    const u16* norm = fold ? folded_norm(t.op, ptr<const u64>(sp, SP_LAYERS) + (size_t)t.layer * LP_COUNT) : nullptr;
    const bool deferred = early && t.wait >= 0 && defers_wait(t.op, norm != nullptr);
    if (threadIdx.x == 0) {
      if (trace) trace[3 * k] = global_ns();
      const int j = next_prefetch(tasks, k, last);
      if (j > prefetched) {  // not asked already by the task before
        prefetch_task<Wt>(tasks[j], sp, si);
        prefetched = j;
      }
      step_wait_counter = deferred ? counters + t.wait : nullptr;
      step_wait_target = t.target;
      step_wait_stamp = deferred && trace ? trace + 3 * k + 1 : nullptr;
      if (t.wait >= 0 && !deferred) wait_for(counters + t.wait, t.target);
    }
    __syncthreads();  // thread 0's acquire covers the CTA: what the waited-on tasks wrote is seen
    if (trace && threadIdx.x == 0 && !deferred) trace[3 * k + 1] = global_ns();
    if (t.op == OP_GATE_UP && k + 1 < last && threadIdx.x < 32 && tasks[k + 1].op == OP_DOWN)
      prefetch_down<Wt>(tasks[k + 1], sp, si);
    if (norm) {
      for (int b = 0; b < si[SI_ROWS]; ++b) {
        add_norm_row<u16>(b, si[SI_ROWS], x, nullptr, ptr<const u16>(sp, SP_H), nullptr, norm, si[SI_HIDDEN],
                          as_float(si[SI_EPS]));
        __syncthreads();  // block_sum's partials are read before the next row writes them
      }
    }
    for (int i = t.begin; i < t.end; ++i) {
      run_tile<Wt, U>(t.op, t.layer, i, sp, si, x, q);
      __syncthreads();  // the body's shared memory is free again; every write of the task is done
      // the first tile waited: the others need not (a warp that still reads the old pointer waits
      // on a count already reached; the next task's is set after the barrier of its last tile)
      if (threadIdx.x == 0) step_wait_counter = nullptr;
    }
    if (threadIdx.x == 0) {
      // release: the CTA's writes (ordered before by the barrier) are seen by whoever acquires the count
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counters + t.signal) : "memory");
      if (trace) trace[3 * k + 2] = global_ns();
    }
  }
  // Every CTA counts itself out; the last zeroes the counters (and the count) for the next launch.
  if (threadIdx.x == 0) {
    __threadfence();
    last_out = atomicAdd(counters + num_counters, 1) == (int)gridDim.x - 1;
  }
  __syncthreads();
  if (last_out)
    for (int j = threadIdx.x; j <= num_counters; j += blockDim.x) counters[j] = 0;
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS, 8 / STEP_WARPS)
decode_step_nvfp4(const StepTask* tasks, const int* task_start, int* counters, int num_counters,
                  const u64* step_ptrs, const int* step_ints, u64* trace) {
  decode_step<Nvfp4Weights, NVFP4_UNROLL>(tasks, task_start, counters, num_counters, step_ptrs, step_ints, trace);
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS, 8 / STEP_WARPS)
decode_step_bf16(const StepTask* tasks, const int* task_start, int* counters, int num_counters,
                 const u64* step_ptrs, const int* step_ints, u64* trace) {
  decode_step<Bf16Weights, BF16_UNROLL>(tasks, task_start, counters, num_counters, step_ptrs, step_ints, trace);
}
