"""Decode attention on the paged KV layout: Q/K norm + RoPE + KV write, then split-KV attention with sinks.

One new token per request, B <= 1024 (the grouped path's batches); head dim 128 and 8 query heads per KV head (H = 8 G) are
fixed by cuda/qk_norm_rope_kv.cu and cuda/decode_attention.cu. Pools are one layer's K or V view
of executor/kv_cache.py, contiguous: `full[i, 0]` [num_blocks, block_size, G, 128] or
`ring[i, 0]` [num_slots, ring_rows, G, 128] (ring_rows >= the window: core/kv_allocator.ring_rows),
bf16 or e4m3 (KV_DTYPES: `--kv-cache-dtype fp8`, scale 1, writes saturating at +-448).
Splits depend only on (batch, a host-side bound on the
context), so a CUDA graph captured for a bound stays valid while the device-side seq_lens grow.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.hardware import sm_count
from flint_sched.kernels.linear import check_tensor

HEAD_DIM = 128
GROUP = 8                    # query heads per KV head
MAX_BATCH = 1024
MAX_KV_HEADS = 8
NORM_WARPS = 8               # cuda/qk_norm_rope_kv.cu QKN_WARPS: heads per CTA
ATTN_THREADS = 128           # cuda/decode_attention.cu: 4 warps ...
ATTN_SMEM_BYTES = 4 * 2 * 2 * 16 * (HEAD_DIM * 2 + 16)   # ... x 2 stages x (K + V) x 16 keys x 272 B = 68 KiB
# e4m3 rows of 144 B: a tile is half the bytes, so FP8_STAGES stages keep as many bytes in flight
FP8_STAGES = 4
# KV dtypes whose tiles come by cp.async (16 bytes a lane, whole rows per warp instruction, 32
# arrivals a stage) rather than one bulk copy a row. Bulk copies cap near ~17 G rows/s: e4m3's
# 128-byte rows then read at 2.2 TB/s, by cp.async at 3.1 TB/s (-28 % at 256 requests, 1,536 keys);
# bf16 rows are bandwidth-bound either way (3.8 TB/s, +-2 %). bench_attention.py --loads, RESULTS.md
# session 20.
CP_ASYNC_DTYPES = (torch.float8_e4m3fn,)
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)        # the cache's element types (KV_FP8 compiles)
MIN_SPLIT_KEYS = 64          # cuda/decode_attention.cu ATTN_MIN_SPLIT_KEYS (a define from here)
MAX_SPLITS = 128
# NOTE: 68 KiB of shared memory and <= 168 registers a thread (160 bf16, 158 e4m3) let three CTAs
# share an SM (228 KiB, 64 K registers; tests/test_kernels_compile_attention.py checks the builds):
# a grid of 3 CTAs per SM is one full wave. Measured on the H200,
# three CTAs of 2 stages beat two of 3 stages: the per-warp tile loop is latency-bound.
CTAS_PER_SM = 3
# Past one wave: when one split per (request, KV head) leaves the last wave of CTAs poorly filled,
# more splits can pay for long requests (bench_attention.py, 64 requests, 4K keys: a full layer 176
# -> 143 µs with 3 splits against 1; RESULTS.md, session 17). decode_splits weighs waves x (keys a
# split + SPLIT_OVERHEAD_KEYS) (the overhead fitted to those runs: 1-4 splits at 64 / 256 requests,
# 1K / 4K keys; it overstates the gain, -28 % for the measured -19 %), up to MAX_WIDE_SPLITS, taking
# more waves only for a modelled gain of WIDE_GAIN; requests too short for that gain then take one
# split (`one_split_below`). WIDE_SPLITS False: one wave at most, as before.
WIDE_SPLITS = True
SPLIT_OVERHEAD_KEYS = 169
MAX_WIDE_SPLITS = 4
WIDE_GAIN = 0.1
MERGE_GROUP = 16             # cuda/decode_attention.cu: splits per first-level merge
# u32 tickets at the start of the workspace: one final ticket per (request, kv head), then one
# per merge group of each (MAX_SPLITS / MERGE_GROUP = 8)
TICKET_SLOTS = MAX_BATCH * MAX_KV_HEADS * (1 + MAX_SPLITS // MERGE_GROUP)
PARTIAL_FLOATS = GROUP * HEAD_DIM + 2 * GROUP    # o[8][128], m[8], l[8] per (request, kv head, split)
LOG2E = 1.4426950408889634


@functools.cache
def _kernel(source: str, name: str, defines: tuple = ()) -> Kernel:
    return compile_kernel(source, name, dict(defines))


def fp8_smem_bytes(stages: int) -> int:
    """The e4m3 kernel's tiles: 4 warps x stages x (K + V) x 16 keys x 144 B."""
    return 4 * stages * 2 * 16 * (HEAD_DIM + 16)


def kv_defines(pool: torch.Tensor) -> tuple:
    """The compile-time settings of a kernel over this KV pool's element type."""
    return (("KV_FP8", 1),) if pool.dtype == torch.float8_e4m3fn else ()


def decode_splits(batch: int, max_keys: int, kv_heads: int = 4) -> int:
    """Splits per (request, KV head): fill one wave (CTAS_PER_SM per SM), >= MIN_SPLIT_KEYS keys each;
    or, with WIDE_SPLITS, more waves where the cost model (above) says they pay at max_keys.

    max_keys is a host-side bound (the longest context the launch, or graph, must serve; the
    window for sliding layers); shorter requests use fewer splits on the device.
    """
    pairs, wave = batch * kv_heads, target_ctas()
    by_keys = max(1, -(-max_keys // MIN_SPLIT_KEYS))
    splits = min(max(1, wave // pairs), by_keys, MAX_SPLITS)
    if not WIDE_SPLITS:
        return splits
    one_wave, best = splits, _split_cost(pairs, splits, max_keys) * (1 - WIDE_GAIN)
    for wide in range(one_wave + 1, min(MAX_WIDE_SPLITS, by_keys) + 1):
        if (cost := _split_cost(pairs, wide, max_keys)) < best:
            splits, best = wide, cost
    return splits


def one_split_below(batch: int, splits: int, kv_heads: int = 4) -> int:
    """Keys under which a request takes one split though the grid has `splits` (0: none do): where
    the grid spans more waves than one split a request would, the length from which the cost model
    (above) gains WIDE_GAIN, at least MIN_SPLIT_KEYS a split."""
    pairs, wave = batch * kv_heads, target_ctas()
    if splits == 1 or pairs * splits <= wave:
        return 0
    waves_one, waves = -(-pairs // wave) * (1 - WIDE_GAIN), -(-pairs * splits // wave)
    per_key = waves_one - waves / splits                 # the model's saving a key, less the gain asked
    if per_key <= 0:
        return 1 << 30
    return max(splits * MIN_SPLIT_KEYS, math.ceil(SPLIT_OVERHEAD_KEYS * (waves - waves_one) / per_key))


def _split_cost(pairs: int, splits: int, keys: int) -> int:
    """The cost model: waves of CTAs x (keys a split + SPLIT_OVERHEAD_KEYS)."""
    return -(-pairs * splits // target_ctas()) * (-(-keys // splits) + SPLIT_OVERHEAD_KEYS)


def target_ctas() -> int:
    """CTAs of one full wave of the attention kernel on the current GPU."""
    return sm_count() * CTAS_PER_SM


def workspace_partials(max_batch: int = MAX_BATCH, kv_heads: int = 4) -> int:
    """Partial slots any `decode_splits` choice needs: batch * kv_heads * splits <= this."""
    return max(target_ctas(), max_batch * kv_heads * (MAX_WIDE_SPLITS if WIDE_SPLITS else 1))


def attention_workspace(device: torch.device | str, max_batch: int = MAX_BATCH, kv_heads: int = 4,
                        max_splits: int | None = None) -> torch.Tensor:
    """fp32 scratch, zeroed: TICKET_SLOTS u32 tickets (kept zero between launches), then partials.

    Size: 4 * (73728 + workspace_partials * 1040) bytes (2 MB for Flint at batch 8); `max_splits` makes room
    for forced `num_splits` up to it. One workspace per stream.
    """
    slots = workspace_partials(max_batch, kv_heads)
    if max_splits is not None:
        slots = max(slots, max_batch * kv_heads * max_splits)
    return torch.zeros(TICKET_SLOTS + slots * PARTIAL_FLOATS, dtype=torch.float32, device=device)


# ---- Q/K norm + RoPE + KV write ---------------------------------------------------------------


def qk_norm_rope_kv_full(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                         positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, eps: float, q_out: torch.Tensor | None = None,
                         pdl: bool = False) -> torch.Tensor:
    """Full layer (no RoPE): q_out [B, H, 128] = rms_norm(q); K/V rows of positions[b] via block_tables.

    positions int32 [B] (< 0: padding, nothing written); block_tables int32 [B, max_blocks].
    """
    b = _check_tables(block_tables, qkv)
    return _norm_rope_kv(qkv, q_norm_weight, k_norm_weight, positions, k_cache, v_cache, block_tables,
                         block_tables.shape[1], None, eps, None, q_out, pdl, b)


def qk_norm_rope_kv_sliding(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                            positions: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                            ring_slots: torch.Tensor, eps: float, rope_theta: float,
                            q_out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Sliding layer: q_out = rope(rms_norm(q)); K/V at row positions[b] % ring rows of ring_slots[b]."""
    if not rope_theta > 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    b = qkv.shape[0] if isinstance(qkv, torch.Tensor) and qkv.dim() == 2 else -1
    check_tensor(ring_slots, "ring_slots", torch.int32, (b,), qkv.device, 4)
    return _norm_rope_kv(qkv, q_norm_weight, k_norm_weight, positions, k_ring, v_ring, None, 0, ring_slots,
                         eps, rope_inv_freq(float(rope_theta), qkv.device), q_out, pdl, b)


@functools.cache
def rope_inv_freq(theta: float, device: torch.device) -> torch.Tensor:
    """fp64 [64] theta^(-2i/128), computed as model/reference.py's rope_cos_sin does.

    Built (and cached) on the first call for a (theta, device): make that call before capturing
    a CUDA graph.
    """
    return theta ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64, device=device) / HEAD_DIM)


def _norm_rope_kv(qkv, q_norm_weight, k_norm_weight, positions, k_pool, v_pool, block_tables, table_stride,
                  ring_slots, eps, inv_freq, q_out, pdl, b) -> torch.Tensor:
    g = _check_pools(k_pool, v_pool)
    h = GROUP * g
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or not qkv.is_cuda:
        raise ValueError("qkv must be a CUDA tensor [B, (H + 2G) * 128]")
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"batch {b} outside 1..{MAX_BATCH}")
    dev = qkv.device
    _check_qkv(qkv, q_norm_weight, k_norm_weight, positions, b, g, dev)
    if k_pool.device != dev:
        raise ValueError(f"KV pools are on {k_pool.device}, expected {dev}")
    if q_out is None:
        q_out = torch.empty(b, h, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    check_tensor(q_out, "q_out", torch.bfloat16, (b, h, HEAD_DIM), dev)
    grid = (b, -(-(h + 2 * g) // NORM_WARPS))
    _kernel("qk_norm_rope_kv.cu", "qk_norm_rope_kv_bf16", kv_defines(k_pool)).launch(
        grid, (NORM_WARPS * 32,),
        [q_out, k_pool, v_pool, qkv, q_norm_weight, k_norm_weight, positions, block_tables, I32(table_stride),
         ring_slots, I32(k_pool.shape[1]), I32(h), I32(g), F32(eps), inv_freq],
        pdl=pdl, device=dev.index)
    return q_out


# ---- split-KV attention ------------------------------------------------------------------------


def decode_attention_full(q: torch.Tensor | QKNorm, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor,
                          workspace: torch.Tensor, max_seq_len: int, out: torch.Tensor | None = None,
                          num_splits: int | None = None, softmax_scale: float | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """out [B, H, 128] = attention of q over keys 0 .. seq_lens[b]-1 read through block_tables.

    q [B, H, 128] bf16: contiguous, or a view whose rows are further apart (`_check_q`: a prompt
    step's decode rows attend from their q/k/v rows in place).

    seq_lens int32 [B] on the device (0: padding, output zeros), each <= max_seq_len, the host
    bound that picks the splits. sinks [H] bf16 or fp32. workspace: `attention_workspace`.
    q a QKNorm: its rows normalized (and the K/V written) by the attention kernel itself (default
    splits and scale only).
    """
    fused = isinstance(q, QKNorm)
    b = _check_tables(block_tables, q.qkv if fused else q)
    if not 1 <= max_seq_len <= block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} must be in 1..max_blocks * block_size")
    return _attention(None if fused else q, k_cache, v_cache, block_tables, block_tables.shape[1], None, 0, seq_lens,
                      sinks, workspace, max_seq_len, out, num_splits, softmax_scale, pdl, b, q if fused else None)


def decode_attention_sliding(q: torch.Tensor | QKNorm, k_ring: torch.Tensor, v_ring: torch.Tensor,
                             ring_slots: torch.Tensor,
                             seq_lens: torch.Tensor, sinks: torch.Tensor, workspace: torch.Tensor,
                             out: torch.Tensor | None = None, num_splits: int | None = None,
                             softmax_scale: float | None = None, pdl: bool = False,
                             window: int | None = None) -> torch.Tensor:
    """out = attention over the last min(seq_lens[b], window) positions; position p at ring row
    p % ring rows (window: the model's, at most the ring's rows; default the ring's rows). q: as
    decode_attention_full's."""
    fused = isinstance(q, QKNorm)
    x = q.qkv if fused else q
    if not isinstance(x, torch.Tensor):
        raise ValueError("q must be a CUDA tensor [B, H, 128]")
    b = x.shape[0] if x.dim() == (2 if fused else 3) else -1
    check_tensor(ring_slots, "ring_slots", torch.int32, (b,), x.device, 4)
    window = k_ring.shape[1] if window is None else window
    if not 1 <= window <= k_ring.shape[1]:
        raise ValueError(f"window {window} must be in 1..{k_ring.shape[1]} (the ring's rows)")
    return _attention(None if fused else q, k_ring, v_ring, None, 0, ring_slots, window, seq_lens, sinks, workspace,
                      window, out, num_splits, softmax_scale, pdl, b, q if fused else None)


@dataclass(frozen=True)
class QKNorm:
    """The Q/K norm operation done by the attention kernel (cuda/decode_attention_qk.cu) instead of
    `qk_norm_rope_kv_*` before it: the q/k/v rows [B, (H + 2G) * 128], the norm weights, positions
    (< 0: padding, nothing written), eps, rope_theta (sliding layers; None: full layers) and the
    CTAs' q slots (`q_slots_elements`). The same bits as the two launches."""

    qkv: torch.Tensor
    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    positions: torch.Tensor
    eps: float
    rope_theta: float | None
    q_slots: torch.Tensor


def q_slots_elements(max_batch: int, max_keys: int, kv_heads: int) -> int:
    """bf16 elements of QKNorm.q_slots for batches up to max_batch over up to max_keys keys: a slot of
    H heads per CTA (one CTA a split of a (request, KV head))."""
    return max(b * kv_heads * decode_splits(b, max_keys, kv_heads) for b in range(1, max_batch + 1)) * (
        GROUP * kv_heads * HEAD_DIM)


def _attention(q, k_pool, v_pool, block_tables, table_stride, ring_slots, window, seq_lens, sinks, workspace,
               max_keys, out, num_splits, softmax_scale, pdl, b, qk: QKNorm | None = None) -> torch.Tensor:
    """The split-KV attention launch; with `qk`, the kernel that does the Q/K norm operation first."""
    g = _check_pools(k_pool, v_pool)
    h = GROUP * g
    x = q if qk is None else qk.qkv
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if qk is None else 2) or not x.is_cuda:
        raise ValueError("q must be a CUDA tensor [B, H, 128]" if qk is None else
                         "qkv must be a CUDA tensor [B, (H + 2G) * 128]")
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"batch {b} outside 1..{MAX_BATCH}")
    dev = x.device
    if qk is None:
        q_stride = _check_q(q, b, h)
    else:
        if num_splits is not None or softmax_scale is not None:
            raise ValueError("the Q/K norm inside attention takes the default splits and scale")
        _check_qkv(qk.qkv, qk.q_norm_weight, qk.k_norm_weight, qk.positions, b, g, dev)
        if qk.rope_theta is not None and not qk.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {qk.rope_theta}")
    check_tensor(seq_lens, "seq_lens", torch.int32, (b,), dev, 4)
    if sinks.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"sinks must be bf16 or fp32, got {sinks.dtype}")
    check_tensor(sinks, "sinks", sinks.dtype, (h,), dev, 4)
    if k_pool.device != dev:
        raise ValueError(f"KV pools are on {k_pool.device}, expected {dev}")
    splits = decode_splits(b, max_keys, g) if num_splits is None else num_splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {splits} outside 1..{MAX_SPLITS}")
    one_below = one_split_below(b, splits, g) if num_splits is None else 0    # forced: every request splits
    need = TICKET_SLOTS + b * g * splits * PARTIAL_FLOATS
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(f"workspace must be fp32 with >= {need} elements (attention_workspace)")
    check_tensor(workspace, "workspace", torch.float32, tuple(workspace.shape), dev)
    if out is None:
        out = torch.empty(b, h, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    check_tensor(out, "out", torch.bfloat16, (b, h, HEAD_DIM), dev)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else softmax_scale
    fp8 = k_pool.dtype == torch.float8_e4m3fn
    stages = (("ATTN_STAGES", FP8_STAGES),) if fp8 else ()
    cp_async = (("ATTN_CP_ASYNC", 1),) if k_pool.dtype in CP_ASYNC_DTYPES else ()
    defines = (("ATTN_MIN_SPLIT_KEYS", MIN_SPLIT_KEYS), *cp_async, *kv_defines(k_pool), *stages, *tickets.defines())
    attend = [k_pool, v_pool, block_tables, I32(table_stride), ring_slots, I32(k_pool.shape[1]), I32(window),
              seq_lens, I32(one_below), sinks, I32(sinks.dtype == torch.bfloat16), F32(scale * LOG2E), workspace,
              workspace[TICKET_SLOTS:]]
    if qk is None:
        source, name, args = "decode_attention.cu", "decode_attention_bf16", [out, q, I32(q_stride), *attend]
    else:
        slots = qk.q_slots
        if slots.dtype != torch.bfloat16 or not slots.is_contiguous() or slots.numel() < b * g * splits * h * HEAD_DIM:
            raise ValueError(f"q_slots must be contiguous bf16 with >= {b * g * splits * h * HEAD_DIM} elements")
        inv_freq = None if qk.rope_theta is None else rope_inv_freq(float(qk.rope_theta), dev)
        source, name = "decode_attention_qk.cu", "decode_attention_qk_bf16"
        args = [out, slots, qk.qkv, qk.q_norm_weight, qk.k_norm_weight, qk.positions, inv_freq, F32(qk.eps), *attend]
    _kernel(source, name, defines).launch((splits, g, b), (ATTN_THREADS,), args,
                                          shared_bytes=fp8_smem_bytes(FP8_STAGES) if fp8 else ATTN_SMEM_BYTES,
                                          pdl=pdl, device=dev.index)
    return out


# ---- checks ------------------------------------------------------------------------------------


def _check_qkv(qkv, q_norm_weight, k_norm_weight, positions, b: int, g: int, dev: torch.device) -> None:
    """The Q/K norm operation's inputs: q/k/v rows [b, (8g + 2g) * 128] (or None: not in memory), norm
    weights [128], positions [b]."""
    if qkv is not None:
        check_tensor(qkv, "qkv", torch.bfloat16, (b, (GROUP * g + 2 * g) * HEAD_DIM), dev)
    check_tensor(q_norm_weight, "q_norm_weight", torch.bfloat16, (HEAD_DIM,), dev)
    check_tensor(k_norm_weight, "k_norm_weight", torch.bfloat16, (HEAD_DIM,), dev)
    check_tensor(positions, "positions", torch.int32, (b,), dev, 4)


def _check_q(q: torch.Tensor, b: int, h: int) -> int:
    """Elements from one request's q heads to the next: q [B, H, 128] bf16, contiguous or a view of
    rows further apart (a prompt step's q/k/v rows: the q heads first), 16-byte aligned."""
    if q.dtype != torch.bfloat16 or tuple(q.shape) != (b, h, HEAD_DIM):
        raise ValueError(f"q must be bf16 [{b}, {h}, {HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    stride = q.stride(0) if b > 1 else h * HEAD_DIM
    if q.stride()[1:] != (HEAD_DIM, 1) or stride < h * HEAD_DIM or stride % 8 or q.data_ptr() % 16:
        raise ValueError(f"q must be [B, H, 128] with rows >= H * 128 elements apart (a multiple of 8) and "
                         f"16-byte aligned, got strides {q.stride()}")
    return stride


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> int:
    """KV heads G of a K/V pool pair [pages, page_rows, G, 128], both of one dtype of KV_DTYPES."""
    if not isinstance(k_pool, torch.Tensor) or k_pool.dim() != 4 or k_pool.shape[-1] != HEAD_DIM:
        raise ValueError(f"k pool must be [pages, rows, kv_heads, {HEAD_DIM}]")
    g = k_pool.shape[2]
    if not 1 <= g <= MAX_KV_HEADS:
        raise ValueError(f"kv_heads {g} outside 1..{MAX_KV_HEADS}")
    if k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"KV pools must be {' or '.join(map(str, KV_DTYPES))}, got {k_pool.dtype}")
    if isinstance(v_pool, torch.Tensor) and v_pool.dtype != k_pool.dtype:
        raise ValueError(f"K and V pools must have one dtype, got {k_pool.dtype} and {v_pool.dtype}")
    check_tensor(k_pool, "k pool", k_pool.dtype, tuple(k_pool.shape), k_pool.device)
    check_tensor(v_pool, "v pool", k_pool.dtype, tuple(k_pool.shape), k_pool.device)
    return g


def _check_tables(block_tables: torch.Tensor, x: torch.Tensor) -> int:
    """Batch size of x, checked against block_tables int32 [B, max_blocks]."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("activations must be a CUDA tensor with a leading batch dimension")
    b = x.shape[0]
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[1] < 1:
        raise ValueError("block_tables must be int32 [B, max_blocks]")
    check_tensor(block_tables, "block_tables", torch.int32, (b, block_tables.shape[1]), x.device, 4)
    return b
