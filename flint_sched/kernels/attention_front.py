"""A fused decode step's attention front in one launch (cuda/qkv_fused.cu): the layer's input norm,
the q/k/v GEMV, the Q/K norms, RoPE and the K/V write, the bits of `rms_norm`, `linear` (4 warps) and
kernels/attention.py `qk_norm_rope_kv_*` (kernel_ops.FUSED_QKV). A cluster of 8 CTAs a head
(QKV_FUSED_HEADS), or a grid of resident CTAs on a grid counter.
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import F32, I32, Kernel
from flint_sched.kernels.attention import (GROUP, HEAD_DIM, _check_pools, _check_qkv, _check_tables, _kernel,
                                           kv_defines, rope_inv_freq)
from flint_sched.kernels.hardware import sm_count
from flint_sched.kernels.linear import (check_activations, check_row_splits, check_tensor, output, weight_args,
                                        weight_format)
from flint_sched.kernels.norm import MAX_HIDDEN
from flint_sched.kernels.smem_tiles import slot_bytes

# cuda/qkv_fused.cu: q/k/v tiles a CTA at most through shared-memory slots (QF_SLOTS), its threads,
# its CTAs a SM (QF_MIN_CTAS: 2 cap the registers at 128, where ptxas spills a few bytes), and the
# dynamic shared memory it may have beside its ~5.3 KiB of static. NVFP4 tiles go through the slots
# (QKV_FUSED_NVFP4_SLOTS) or are read from global memory as gemv.cu reads them, as BF16's always are
# (a BF16 tile is 64 KB), asked of L2 before the wait.
QKV_FUSED_SLOTS = 3
QKV_FUSED_THREADS = 256
QKV_FUSED_CTAS = 1
QKV_FUSED_MAX_SHARED = 227 * 1024 - 8 * 1024
QKV_FUSED_NVFP4_SLOTS = True
# The kernels with a cluster of 8 CTAs a head (qkv_heads_*: one 16-row tile and 128 threads a CTA, the
# head's rows met in CTA 0's shared memory; no grid-wide counter, no residency needed) or the grid of
# resident CTAs with a counter before the per-head work (qkv_fused_*). The heads kind measured
# 2.39 ms a step against the grid kind's 2.49 (an H100, batch 1; RESULTS.md session 35).
QKV_FUSED_HEADS = True
# The cluster kind's tiles reach CTA 0 by st.async, counted on CTA 0's mbarrier, instead of DSMEM
# stores and a second cluster barrier (whose release is a MEMBAR.GPU in every CTA; cuda/qkv_fused.cu
# QH_ST_ASYNC): the same rows. Measured only with the one-launch MoE too (RESULTS.md session 35).
QKV_HEADS_ST_ASYNC = False
QKV_HEADS_THREADS = 128
QKV_HEADS_CTAS = 8            # cuda/qkv_fused.cu QH_CTAS: a head's 128 rows, 16 a CTA


def qkv_fused_slots(fmt: str) -> bool:
    """Whether qkv_fused takes a q/k/v weight of this format through shared-memory slots (NVFP4 only)."""
    return fmt == "nvfp4" and QKV_FUSED_NVFP4_SLOTS


def qkv_fused_bytes(tokens: int, rows: int, hidden: int, slots: bool = True, heads: bool | None = None) -> int | None:
    """Dynamic shared memory of qkv_fused's kernel (its layout in cuda/qkv_fused.cu; heads: the cluster
    a head, None: QKV_FUSED_HEADS) through weight slots or not, or None for shapes it does not take:
    1-8 tokens, hidden a multiple of 256 (whole scale rows a bulk copy) up to the norm's MAX_HIDDEN,
    q/k/v rows whole heads of 128."""
    if not 1 <= tokens <= 8 or hidden % 256 or hidden > MAX_HIDDEN or rows % HEAD_DIM:
        return None
    heads = QKV_FUSED_HEADS if heads is None else heads
    tiles = 1 if heads else QKV_FUSED_SLOTS
    size = (tiles * slot_bytes(hidden) if slots else 0) + tokens * (2 * hidden + 16) + tokens * HEAD_DIM * 4
    if heads:
        size += tokens * HEAD_DIM * 2          # the head's rows, in CTA 0
    return size if size <= QKV_FUSED_MAX_SHARED else None


def qkv_fused(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight, row_splits: tuple[int, int],
              q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, positions: torch.Tensor,
              k_pool: torch.Tensor, v_pool: torch.Tensor, qk_eps: float, counters: torch.Tensor | None,
              block_tables: torch.Tensor | None = None, ring_slots: torch.Tensor | None = None,
              rope_theta: float | None = None, qkv: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
              pdl: bool = False) -> torch.Tensor:
    """q_out [T, H, 128] of a fused decode step's rows x (before the layer's input norm), in one launch
    (cuda/qkv_fused.cu): the bits of `rms_norm`, then `linear(..., row_splits=, warps=4)` over the
    q/k/v weight [(H + 2G) * 128, K] (NVFP4 or bf16), then `qk_norm_rope_kv_full` (block_tables) or
    `qk_norm_rope_kv_sliding` (ring_slots, rope_theta), which writes the K/V rows too.

    QKV_FUSED_HEADS: a cluster of 8 CTAs a head (`counters` unused, may be None); else a grid of as
    many CTAs as the GPU holds at once, waiting on `counters` (kernels/smem_tiles.py `grid_counters`,
    not shared with a launch that may run beside it), so that no other kernel may hold SMs for good
    while it runs. qkv: where the q/k/v rows go [T, (H + 2G) * 128] (scratch; the cluster kind writes
    them only when given)."""
    check_activations(x)
    t, k = x.shape
    g = _check_pools(k_pool, v_pool)
    h, dev = GROUP * g, x.device
    n = (h + 2 * g) * HEAD_DIM
    fmt = weight_format(weight)
    slots = qkv_fused_slots(fmt)
    size = qkv_fused_bytes(t, n, k, slots)
    if size is None:
        raise ValueError(f"qkv_fused does not take {t} tokens x hidden {k} (see qkv_fused_bytes)")
    check_row_splits(row_splits, n)
    if len(row_splits) != 2:
        raise ValueError(f"row_splits must be (q rows, q + k rows), got {row_splits}")
    w_args = weight_args(weight, "weight", (n, k), dev, 3, scales_align=16 if slots else 2)  # slots: bulk copies
    check_tensor(norm_weight, "norm_weight", torch.bfloat16, (k,), dev)
    if counters is not None or not QKV_FUSED_HEADS:     # the grid kind waits on them; a cluster a head does not
        check_tensor(counters, "counters", torch.int32, (2,), dev, 4)
    if (block_tables is None) == (ring_slots is None):
        raise ValueError("give block_tables (a full layer) or ring_slots and rope_theta (a sliding one)")
    if block_tables is not None:
        if rope_theta is not None:
            raise ValueError("full layers take no RoPE")
        _check_tables(block_tables, x)
        table_stride, inv_freq = block_tables.shape[1], None
    else:
        if not (rope_theta or 0) > 0:
            raise ValueError(f"rope_theta must be positive, got {rope_theta}")
        check_tensor(ring_slots, "ring_slots", torch.int32, (t,), dev, 4)
        table_stride, inv_freq = 0, rope_inv_freq(float(rope_theta), dev)
    if qkv is not None or not QKV_FUSED_HEADS:      # the cluster kind keeps the rows in shared memory
        qkv = output(qkv, "qkv", (t, n), x)
    _check_qkv(qkv, q_norm_weight, k_norm_weight, positions, t, g, dev)
    if k_pool.device != dev:
        raise ValueError(f"KV pools are on {k_pool.device}, expected {dev}")
    q_out = output(q_out, "q_out", (t, h, HEAD_DIM), x)
    check_tensor(q_out, "q_out", torch.bfloat16, (t, h, HEAD_DIM), dev)     # 8-byte stores
    tail = [*w_args, I32(row_splits[0]), I32(row_splits[1]), q_norm_weight, k_norm_weight, positions, block_tables,
            I32(table_stride), ring_slots, I32(k_pool.shape[1]), I32(h), I32(g), F32(qk_eps), inv_freq, I32(t), I32(n),
            I32(k)]
    kind = "heads" if QKV_FUSED_HEADS else "fused"
    name = f"qkv_{kind}_nvfp4" if slots else f"qkv_{kind}_direct_{fmt}"
    kernel = _kernel("qkv_fused.cu", name, kv_defines(k_pool) + (("QF_MIN_CTAS", QKV_FUSED_CTAS),
                                                                 ("QH_ST_ASYNC", int(QKV_HEADS_ST_ASYNC)),
                                                                 *tickets.defines()))
    if QKV_FUSED_HEADS:     # a cluster a head, shared memory first (3 CTAs a SM: one wave)
        _prefer_shared(kernel, size, dev.index)
        kernel.launch((n // 16,), (QKV_HEADS_THREADS,), [q_out, k_pool, v_pool, qkv, x, norm_weight, F32(eps), *tail],
                      shared_bytes=size, pdl=pdl, device=dev.index)
        return q_out
    ctas = min(_resident(kernel, size, dev.index), n // 16)
    if slots and n // 16 > ctas * QKV_FUSED_SLOTS:
        raise ValueError(f"qkv_fused: {n // 16} tiles of q/k/v rows need more than this GPU's {ctas} resident CTAs "
                         f"x {QKV_FUSED_SLOTS} slots")
    kernel.launch((ctas,), (QKV_FUSED_THREADS,), [q_out, k_pool, v_pool, qkv, counters, x, norm_weight, F32(eps), *tail],
                  shared_bytes=size, pdl=pdl, device=dev.index)
    return q_out


@functools.cache
def _resident(kernel: Kernel, shared_bytes: int, device: int | None) -> int:
    """CTAs of a one-launch block the GPU holds at once (every one waits on all the others)."""
    return kernel.resident_blocks(QKV_FUSED_THREADS, shared_bytes, device) * sm_count()


@functools.cache
def _prefer_shared(kernel: Kernel, shared_bytes: int, device: int | None) -> None:
    """The cluster kind's carveout, set once per kernel and size."""
    kernel.prefer_shared(shared_bytes, device)
