"""Grouped skinny GEMMs for any number of tokens (cuda/grouped_gemm.cu): planning and dense launchers.

Rows are cut into items of CHUNK rows (16 or 64, a compile-time define); a CTA applies each weight
fragment of its 16-row tiles to every 8-row group of one item, so a weight is read from HBM once
per call and from L2 by the other items. The planning functions here are pure Python (CPU tests):
`dense_chunk` / `moe_chunk` pick CHUNK, `work_bound` sizes MoE grids for CUDA graphs (the real
item count stays on the GPU), `tiles_per_cta` picks GROUPED_TILES. MoE launchers: grouped_moe.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flint_sched.kernels._runtime import I32, Kernel, compile_kernel
from flint_sched.kernels.hardware import sm_count
from flint_sched.kernels.linear import (Weight, cdiv, check_row_splits, check_tensor, gate_up_args, weight_args,
                                        weight_format)
from flint_sched.kernels.norm import MAX_PARTS as MAX_NORM_PARTS, add_rms_norm_f32, rms_norm

CHUNKS = (8, 16, 64)       # rows per item (cuda/grouped_gemm.cu GROUPED_CHUNK)
# Rows per item of the MoE GEMMs for decode-sized steps (<= 16 rows per touched expert on
# average; NVFP4 decode runs kernels/expert_decode.py, so this is BF16's and small prompt steps').
# 8 = one row group per item: the k-loop's SASS is ~23 % shorter than at 16 (the second group's
# loads, PRMTs and HMMAs issue even when predicated off), but an expert with more than 8 rows takes
# two items (its weights read again, from L2). Measured on the H200, full model BF16 at 1K
# (benchmarks/ab_decode.py, RESULTS.md session 13), ms a step at 9 / 16 / 64 / 256 requests: 16-row
# items 6.70 / 8.32 / 13.00 / 20.94, 8-row 6.39 / 7.95 / 12.87 / 20.96. (NVFP4 in session 7's
# kernel benchmark: 8-row items 69 / 131 / 271 µs at 16 / 64 / 256 tokens, 16-row 74 / 137 / 254.)
MOE_SMALL_CHUNK = 8
TILES_PER_CTA = (1, 4)     # 16-row weight tiles per CTA (GROUPED_TILES)
WARPS = 4                  # GG_WARPS
TILE_ROWS = 16
MAX_GRID_Y = 65535


# Extra compile-time defines (GG_MIN_CTAS, BF16_UNROLL, NVFP4_UNROLL) for tuning experiments
# (benchmarks/bench_grouped.py --define); empty in serving, where the .cu defaults apply.
TUNING: dict[str, int] = {}


@functools.cache
def _kernel(name: str, chunk: int, tiles: int, tuning: tuple = ()) -> Kernel:
    return compile_kernel("grouped_gemm.cu", name, {"GROUPED_CHUNK": chunk, "GROUPED_TILES": tiles, **dict(tuning)})


def gemm_kernel(name: str, fmt: str, chunk: int, tiles: int) -> Kernel:
    """grouped_<name>_<fmt> of cuda/grouped_gemm.cu in the (chunk, tiles) variant."""
    if chunk not in CHUNKS or tiles not in TILES_PER_CTA:
        raise ValueError(f"no compiled variant for chunk {chunk}, tiles {tiles}")
    return _kernel(f"grouped_{name}_{fmt}", chunk, tiles, tuple(sorted(TUNING.items())))


# ---- planning (pure Python) ------------------------------------------------------------------


def dense_chunk(num_rows: int) -> int:
    """16 rows per item up to 16 rows (2 groups of 8: fewer registers), else 64."""
    return 16 if num_rows <= 16 else 64


def moe_chunk(num_tokens: int, top_k: int, num_experts: int) -> int:
    """By the mean rows per touched routed expert (num_tokens * top_k pairs over at most
    num_experts experts): MOE_SMALL_CHUNK while it is <= 16 (decode: 1-6 at 16-256 tokens), else 64."""
    pairs = num_tokens * top_k
    mean_rows = pairs / max(1, min(num_experts, pairs))
    return MOE_SMALL_CHUNK if mean_rows <= 16 else 64


def work_bound(num_tokens: int, top_k: int, num_experts: int, chunk: int) -> int:
    """Most items the work list of num_tokens tokens can hold (each token: top_k distinct routed
    experts of num_experts, and one row of the shared expert). A routed expert with c >= 1 rows has
    ceil(c / chunk) = 1 + (c - 1) // chunk items; over the T touched experts that sums to at most
    T + (R - T) // chunk (R = num_tokens * top_k routed rows), which grows with T, so T = min(E, R)
    bounds it; the shared expert adds ceil(num_tokens / chunk)."""
    routed = num_tokens * top_k
    touched = min(num_experts, routed)
    return touched + (routed - touched) // chunk + cdiv(num_tokens, chunk)


def tiles_per_cta(num_items: int, num_tiles: int, chunk: int, sms: int) -> int:
    """4 tiles per CTA (one per warp: its x rows are shared by the 4 warps in L1, 4x less L2
    traffic) where items are large and the grid still has >= 4 CTAs per SM; else 1 (the warps
    split K: more CTAs for small grids)."""
    if chunk == 64 and num_items * cdiv(num_tiles, 4) >= 4 * sms:
        return TILES_PER_CTA[1]
    return TILES_PER_CTA[0]


def grid(num_items: int, num_tiles: int, tiles: int) -> tuple[int, int]:
    """(items, tile groups): blockIdx.x = item, so the items of one expert run side by side."""
    y = cdiv(num_tiles, tiles)
    if y > MAX_GRID_Y:
        raise ValueError(f"{num_tiles} row tiles need {y} > {MAX_GRID_Y} CTAs in grid y")
    return num_items, y


# ---- checks ----------------------------------------------------------------------------------


def check_rows(x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    """x bf16 [M, K], M >= 1, on a CUDA device, contiguous, fewer than 2^32 elements (u32 offsets)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [tokens, features]")
    if not x.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    if x.shape[0] < 1:
        raise ValueError(f"{name} needs at least one row")
    if x.numel() >= 1 << 32:
        raise ValueError(f"{name} has {x.numel()} elements; the kernels index it with 32 bits")
    check_tensor(x, name, torch.bfloat16, tuple(x.shape), x.device)
    return x.shape[0], x.shape[1]


def check_work_list(routing, chunk: int, rows_needed: int, num_experts: int, what: str) -> None:
    """A routing (grouped_moe.Routing) whose work list is of `chunk`-row items, sorted for weights of
    `num_experts` experts and `rows_needed` sorted rows; `what` names the GEMMs in the message."""
    if routing.chunk != chunk:
        raise ValueError(f"{what} needs a work list of {chunk}-row items "
                         f"(route_and_sort(..., chunk={chunk})), got chunk {routing.chunk}")
    if routing.num_experts != num_experts or routing.sorted_token.numel() != rows_needed:
        raise ValueError(f"weights have {num_experts} experts / {rows_needed} rows; routing has "
                         f"{routing.num_experts} / {routing.sorted_token.numel()}")


def out_buffer(out: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               like: torch.Tensor) -> torch.Tensor:
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be bf16 or fp32, got {dtype}")
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(out, name, dtype, shape, like.device, 4 if dtype == torch.float32 else 2)
    return out


# ---- dense launchers -------------------------------------------------------------------------


CUBLAS_MIN_ROWS_NVFP4 = 17   # NVFP4 weights go to dequantize + cuBLAS from this many rows on


def use_cublas(fmt: str, num_rows: int, cublas: bool | None) -> bool:
    """Where cuBLAS serves a call (None: as measured on the H200, benchmarks/RESULTS.md): BF16
    weights always (q/k/v at 16 / 256 rows: 7.9 / 10.2 µs against 13.0 / 53.9 for our kernel);
    NVFP4 weights from CUBLAS_MIN_ROWS_NVFP4 rows on, dequantized to bf16 once per call (our kernel
    decodes each weight again for every 64-row chunk: q/k/v at 256 rows took 70 µs, the LM head
    1.5 ms). NOTE: the dequantized weights are rounded to bf16 (value x tensor scale, 2^-9 relative),
    as a BF16 checkpoint's are; our kernel keeps the block values exact and scales the fp32 sums."""
    if cublas is not None:
        return cublas
    return fmt == "bf16" or num_rows >= CUBLAS_MIN_ROWS_NVFP4


def _dense_bf16(w: Weight, row_splits: tuple[int, ...], pdl: bool) -> torch.Tensor:
    from flint_sched.kernels.dequant import dequantize_bf16
    return w if weight_format(w) == "bf16" else dequantize_bf16(w, row_splits=row_splits, pdl=pdl)


@functools.cache
def mm_out_fp32_supported(device: torch.device, batched: bool = False) -> bool:
    """Whether torch.mm (batched: torch.bmm) takes out_dtype=torch.float32 for bf16 inputs here (CUDA,
    torch >= 2.8)."""
    try:
        a = torch.zeros(*((2,) if batched else ()), 16, 16, dtype=torch.bfloat16, device=device)
        return (torch.bmm if batched else torch.mm)(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T with fp32 sums and an fp32 result (cuBLAS), so that an epilogue rounds once."""
    return torch.mm(x, w.t(), out_dtype=torch.float32)


# GEMMs with a residual (o_proj; the dense MLP's down projection; the next RMSNorm in their epilogue)
# of up to NORM_SPLIT_MAX_ROWS rows run as NORM_SPLIT_K split-K parts on cuBLAS (one batched GEMM
# over K / S slices, fp32 out), which add_rms_norm_f32 adds (without the norm: _sum_parts, in the
# same order, so the two give the same bits): o_proj (2048 x 4096) alone at 17-64 rows took
# 9.8-10.0 µs as one GEMM (cuBLAS fills few CTAs at N = 2048), 6.8-7.3 in 4 parts; at 128 rows
# 9.8 -> 7.6, at 256 10.7 -> 9.9 (H200, CUDA graph; RESULTS.md, session 23).
NORM_SPLIT_K = 4
NORM_SPLIT_MAX_ROWS = 128


def mm_f32_parts(x: torch.Tensor, w: torch.Tensor, parts: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
    """x @ w^T (bf16 [M, K] and [N, K]) as `parts` split-K fp32 products [parts, M, N] on cuBLAS: one
    batched GEMM over K / parts slices of both (views, no copies), into `out` where given. None where
    it cannot: fewer than 2 parts, slices not whole 16-byte rows, inputs not contiguous, no bmm
    out_dtype here."""
    m, k = x.shape
    if (parts < 2 or k % (8 * parts) or not (x.is_contiguous() and w.is_contiguous())
            or not mm_out_fp32_supported(x.device, batched=True)):
        return None
    a, b = x.view(m, parts, k // parts).transpose(0, 1), w.t().view(parts, k // parts, w.shape[0])
    if out is None:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b, out_dtype=torch.float32, out=out)


def _mm_f32_parts(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """_mm_f32 as [S, M, N] split-K parts where NORM_SPLIT_K / NORM_SPLIT_MAX_ROWS say, else [M, N]."""
    fits = x.shape[0] <= NORM_SPLIT_MAX_ROWS and NORM_SPLIT_K <= MAX_NORM_PARTS
    parts = mm_f32_parts(x, w, NORM_SPLIT_K) if fits else None
    return _mm_f32(x, w) if parts is None else parts


def _sum_parts(p: torch.Tensor) -> torch.Tensor:
    """[S, M, N] split-K parts -> their sum, added in part order (fp32); [M, N] as it is."""
    if p.dim() == 2:
        return p
    total = p[0].clone()
    for q in range(1, p.shape[0]):
        total += p[q]
    return total


def grouped_linear(x: torch.Tensor, weight: Weight, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                   pdl: bool = False, row_splits: tuple[int, ...] = (), cublas: bool | None = None,
                   norm_weight: torch.Tensor | None = None, norm_out: torch.Tensor | None = None,
                   norm_eps: float = 0.0) -> torch.Tensor:
    """y[M, N] = x @ W^T (+ residual) for any M >= 1: fp32 sums, one rounding to out_dtype
    (bf16, or fp32 for router logits). W: bf16 [N, K] (K % 8 == 0) or NVFP4Tensor (K % 64 == 0).
    `row_splits`: from `concat_rows` (NVFP4 parts keep their tensor scales). `cublas`: see
    `use_cublas` (with a residual or an fp32 output, cuBLAS returns fp32 and the sum is rounded
    once here: its own bf16 epilogue would round the product first). With `norm_weight` (bf16 y,
    a residual), norm_out also receives rms_norm(y) * norm_weight: after cuBLAS in the residual's
    epilogue kernel, after our kernel in a launch of its own."""
    m, k = check_rows(x)
    n = weight.shape[0]
    if tuple(weight.shape) != (n, k):
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    check_row_splits(row_splits, n)
    fmt = weight_format(weight)
    w_args = weight_args(weight, "weight", (n, k), x.device, len(row_splits) + 1)
    if residual is not None:
        check_tensor(residual, "residual", torch.bfloat16, (m, n), x.device, 2)
    y = out_buffer(out, "out", (m, n), out_dtype, x)
    if norm_weight is not None and (residual is None or norm_out is None or out_dtype != torch.bfloat16):
        raise ValueError("norm_weight needs a residual, norm_out and a bf16 output")
    # An fp32 output (the router logits) goes to cuBLAS as well where torch.mm takes out_dtype:
    # measured on the H200 (RESULTS.md, session 10), full model at 1K, our kernel against cuBLAS:
    # batch 64 8.19 -> 8.02 ms a step, batch 256 17.36 -> 17.08.
    if use_cublas(fmt, m, cublas) and (mm_out_fp32_supported(x.device) or (
            residual is None and out_dtype == torch.bfloat16)):
        w = _dense_bf16(weight, row_splits, pdl)
        if residual is None:
            return torch.mm(x, w.t(), out=y) if out_dtype == torch.bfloat16 else \
                torch.mm(x, w.t(), out_dtype=torch.float32, out=y)
        if norm_weight is not None:
            add_rms_norm_f32(_mm_f32_parts(x, w), residual, norm_weight, norm_eps, out=norm_out, residual_out=y,
                             pdl=pdl)
            return y
        # fp32 sum, one rounding (split-K parts added in order first, as add_rms_norm_f32 does)
        return torch.add(_sum_parts(_mm_f32_parts(x, w)), residual, out=y)
    splits = [I32(r) for r in (*row_splits, n, n)[:2]] if fmt == "nvfp4" else []
    chunk = dense_chunk(m)
    items, tiles = cdiv(m, chunk), cdiv(n, TILE_ROWS)
    per_cta = tiles_per_cta(items, tiles, chunk, sm_count(x.device))
    gemm_kernel("linear", fmt, chunk, per_cta).launch(
        grid(items, tiles, per_cta), (32 * WARPS,),
        [y, I32(int(out_dtype == torch.float32)), x, *w_args, residual, I32(m), I32(n), I32(k), *splits],
        pdl=pdl, device=x.device.index)
    if norm_weight is not None:
        rms_norm(y, norm_weight, norm_eps, out=norm_out, pdl=pdl)
    return y


def grouped_gate_up(x: torch.Tensor, gate: Weight, up: Weight, out: torch.Tensor | None = None,
                    pdl: bool = False, cublas: bool | None = None) -> torch.Tensor:
    """h[M, I] = silu(x @ gate^T) * (x @ up^T) for any M >= 1; gate and up [I, K], one format;
    `cublas` as grouped_linear's (fp32 products, SiLU and product in fp32, one rounding)."""
    m, k = check_rows(x)
    i, fmt, args = gate_up_args(gate, up, k, x.device)
    h = out_buffer(out, "out", (m, i), torch.bfloat16, x)
    if use_cublas(fmt, m, cublas) and mm_out_fp32_supported(x.device):
        gate_f32, up_f32 = _mm_f32(x, _dense_bf16(gate, (), pdl)), _mm_f32(x, _dense_bf16(up, (), pdl))
        return torch.mul(F.silu(gate_f32), up_f32, out=h)
    chunk = dense_chunk(m)
    items, tiles = cdiv(m, chunk), cdiv(i, TILE_ROWS // 2)
    per_cta = tiles_per_cta(items, tiles, chunk, sm_count(x.device))
    gemm_kernel("gate_up", fmt, chunk, per_cta).launch(
        grid(items, tiles, per_cta), (32 * WARPS,), [h, x, *args, I32(m), I32(i), I32(k)],
        pdl=pdl, device=x.device.index)
    return h
