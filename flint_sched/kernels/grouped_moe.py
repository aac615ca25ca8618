"""Grouped MoE for any number of tokens (cuda/moe_routing.cu, cuda/grouped_gemm.cu; from
EXPERT_GEMM_MIN_TOKENS on, the tiled expert GEMMs of cuda/expert_gemm.cu), five launches (four where
the decode GEMMs run gate/up and down as one, FUSED_DECODE_CONFIGS):

    logits [M, E] fp32 = x @ router_gate^T                         router_logits (split-K: [S, M, E] parts)
    ids, weights, sorted rows, work list                           route_and_sort (one launch; at
                                                                   <= CLUSTER_ROUTE_MAX_TOKENS tokens
                                                                   inside the expert kernel)
    h_sorted [P, I]  = silu(x[tok] @ Wg_e^T) * (x[tok] @ Wu_e^T)   moe_gate_up_sorted
    y_sorted [P, H]  = h_sorted @ Wd_e^T                           moe_down_sorted
    out [M, H] = residual + sum_a w * y_sorted[pair_row] + shared  moe_finalize (+ the next RMSNorm)

With gemms="hybrid" (HYBRID_MIN_TOKENS), route_and_split writes two work lists from one sort: the
experts of many rows run the tiled GEMMs, the others the decode GEMMs, each writing its own rows.

P = M * (A + 1) rows at most (slot A: the shared expert, expert id E, weight 1). Nothing leaves the
GPU: item counts stay in the workspace and grids are sized by `work_bound`. All buffers live in
one `MoeRoutingWorkspace`, so a call allocates nothing and can be captured in a CUDA graph; the
workspace's ticket resets itself. Tokens t >= num_tokens (a device int32 [1]; padding of a graph
bucket) are not routed and copy their residual. With pdl=True, moe_down_sorted reads the work list
before waiting on its predecessor: launch it right after moe_gate_up_sorted (moe_grouped does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flint_sched.kernels import expert_decode, expert_gemm, tickets
from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.grouped import (CHUNKS, TILE_ROWS, TILES_PER_CTA, WARPS, check_rows, gemm_kernel, grid,
                                         grouped_linear, mm_f32_parts, moe_chunk, out_buffer, work_bound)
from flint_sched.kernels.linear import (Weight, cdiv, check_tensor, expert_args, linear, moe_gate_up_args,
                                        weight_format)
from flint_sched.kernels.norm import MAX_HIDDEN, norm_threads

ROUTING_THREADS = 512       # cuda/moe_routing.cu ROUTING_WARPS * 32
ROUTING_WARPS = ROUTING_THREADS // 32
MAX_EXPERTS = 1024          # router_select: 32 experts per lane
MAX_TOP_K = 32
STAGED_IDS = 2048           # cuda/moe_routing.cu: ids moe_route's last CTA reads into shared memory
MAX_LOGIT_PARTS = 8         # cuda/topk.cuh: split-K parts of the logits the routing kernels sum
FINALIZE_THREADS = 256
MAX_ITEMS = 65535           # the sort counts each class of work items in 16 bits
HEAVY_FIRST = True          # route_and_sort's heavy_first default: 16.77 -> 16.52 ms at 256 requests


# moe_route's sort counts and ranks up to this many tokens by per-expert token masks (one atomicOr
# a pair) instead of per-warp histograms (cuda/moe_routing.cu sort_pairs); 0: histograms always.
SORT_MASK_TOKENS = 256


@functools.cache
def _routing_kernel(name: str, max_experts: int, mask_tokens: int, extra: tuple = ()) -> Kernel:
    return compile_kernel("moe_routing.cu", name, {"ROUTER_MAX_EXPERTS": max_experts, "MASK_TOKENS": mask_tokens,
                                                   **dict(extra)})


def routing_kernel(name: str, num_experts: int) -> Kernel:
    return _routing_kernel(name, 256 if num_experts <= 256 else MAX_EXPERTS, SORT_MASK_TOKENS, tickets.defines())


def routing_shared_bytes(num_experts: int) -> int:
    """Dynamic shared memory of moe_sort and moe_route: the sort's histograms [warps][E + 1] int32 +
    scan [E + 2] u64 + warp totals [32] u64 (the top-k keeps its scores in registers), then the ids
    moe_route's last CTA stages (STAGED_IDS int32)."""
    sort = -(-ROUTING_WARPS * (num_experts + 1) * 4 // 16) * 16 + (num_experts + 2) * 8 + 32 * 8
    return sort + 4 * STAGED_IDS


@dataclass
class MoeRoutingWorkspace:
    """Every buffer of the grouped MoE for up to max_tokens tokens (see the module docstring)."""

    max_tokens: int
    num_experts: int
    top_k: int
    logits: torch.Tensor        # fp32 [max_tokens, E]
    logit_parts: torch.Tensor   # fp32, flat: router_logits' split-K parts [S, M, E] for M <= ROUTER_SPLIT_MAX_ROWS
    ids: torch.Tensor           # int32 [max_tokens, A]
    weights: torch.Tensor       # fp32 [max_tokens, A]
    offsets: torch.Tensor       # int32 [E + 2]
    sorted_token: torch.Tensor  # int32 [P_max]
    pair_row: torch.Tensor      # int32 [max_tokens, A + 1]
    work_expert: torch.Tensor   # int32 [work bound at the smallest chunk]
    work_row: torch.Tensor      # int32 [same]
    num_work: torch.Tensor      # int32 [1]
    ticket: torch.Tensor        # int32 [1], zero between calls
    queue: torch.Tensor         # int32 [1 + max items]: expert_decode_moe's unit counters, zeroed by the routing
    work2_expert: torch.Tensor  # int32 [work bound at expert_gemm.TILE_M]: route_and_split's tiled list
    work2_row: torch.Tensor
    num_work2: torch.Tensor     # int32 [1]
    h_sorted: torch.Tensor | None = None  # bf16 [P_max, I]
    y_sorted: torch.Tensor | None = None  # bf16 [P_max, H]


def moe_routing_workspace(max_tokens: int, num_experts: int, top_k: int, device: torch.device | str,
                          hidden_size: int | None = None, intermediate_size: int | None = None
                          ) -> MoeRoutingWorkspace:
    """Allocate once, reuse every call. hidden_size and intermediate_size add the h/y buffers that
    `moe_grouped` needs (route_and_sort alone does not)."""
    if max_tokens < 1 or not 1 <= num_experts <= MAX_EXPERTS or not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"need max_tokens >= 1, 1 <= num_experts <= {MAX_EXPERTS}, 1 <= top_k <= "
                         f"min(num_experts, {MAX_TOP_K}); got {max_tokens}, {num_experts}, {top_k}")
    pairs = max_tokens * (top_k + 1)
    items = work_bound(max_tokens, top_k, num_experts, min(CHUNKS))
    tiles = work_bound(max_tokens, top_k, num_experts, expert_gemm.TILE_M)

    def ints(*shape):
        return torch.zeros(shape, dtype=torch.int32, device=device)

    def rows(width):
        return None if width is None else torch.empty(pairs, width, dtype=torch.bfloat16, device=device)

    return MoeRoutingWorkspace(
        max_tokens, num_experts, top_k,
        logits=torch.empty(max_tokens, num_experts, dtype=torch.float32, device=device),
        logit_parts=torch.empty(MAX_LOGIT_PARTS * min(max_tokens, ROUTER_SPLIT_MAX_ROWS) * num_experts,
                                dtype=torch.float32, device=device),
        ids=ints(max_tokens, top_k), weights=torch.zeros(max_tokens, top_k, dtype=torch.float32, device=device),
        offsets=ints(num_experts + 2), sorted_token=ints(pairs), pair_row=ints(max_tokens, top_k + 1),
        work_expert=ints(items), work_row=ints(items), num_work=ints(1), ticket=ints(1), queue=ints(1 + items),
        work2_expert=ints(tiles), work2_row=ints(tiles), num_work2=ints(1),
        h_sorted=rows(intermediate_size), y_sorted=rows(hidden_size))


@dataclass
class Routing:
    """Views of a workspace for one call of M tokens; chunk: rows per work item."""

    ids: torch.Tensor           # int32 [M, A]
    weights: torch.Tensor       # fp32 [M, A]
    offsets: torch.Tensor       # int32 [E + 2]
    sorted_token: torch.Tensor  # int32 [M * (A + 1)]
    pair_row: torch.Tensor      # int32 [M, A + 1]
    work_expert: torch.Tensor   # int32 [max_items]
    work_row: torch.Tensor
    num_work: torch.Tensor      # int32 [1]
    num_experts: int
    chunk: int
    max_items: int              # work_bound: grid x of the expert GEMMs

    @property
    def work_args(self) -> list:
        return [self.offsets, self.work_expert, self.work_row, self.num_work]


def route_and_sort(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                   workspace: MoeRoutingWorkspace, num_tokens: torch.Tensor | None = None, pdl: bool = False,
                   chunk: int | None = None, fused: bool = True, heavy_first: bool | None = None) -> Routing:
    """Sigmoid top-k of fp32 logits [M, E] (as route() in model/reference.py), or of the sum of
    split-K parts [S, M, E] (router_logits; S <= MAX_LOGIT_PARTS, added in order), then the counting
    sort by expert; fused: one launch (the last CTA sorts), else moe_topk + moe_sort. heavy_first (None:
    HEAVY_FIRST): the work list holds the items of experts with more than chunk / 2 rows first."""
    heavy = HEAVY_FIRST if heavy_first is None else heavy_first
    return _route(logits, bias, top_k, scaling, workspace, num_tokens, pdl, chunk, fused, heavy, 0)[0]


def route_and_split(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                    workspace: MoeRoutingWorkspace, chunk: int, split: int, num_tokens: torch.Tensor | None = None,
                    pdl: bool = False, fused: bool = True) -> tuple[Routing, Routing]:
    """route_and_sort with two work lists over the same sorted rows: the experts of at most `split`
    rows in items of `chunk` rows (the decode GEMMs'), the others (the shared expert among them once
    M > split) in items of expert_gemm.TILE_M rows (the tiled GEMMs'). Each sorted row is in exactly
    one list's items. Returns (the chunk list, the tiled list)."""
    if split < 1:
        raise ValueError(f"split must be a positive number of rows, got {split}")
    return _route(logits, bias, top_k, scaling, workspace, num_tokens, pdl, chunk, fused, False, split)


def split_bounds(num_tokens: int, top_k: int, num_experts: int, chunk: int, split: int) -> tuple[int, int]:
    """Most items route_and_split's two lists can hold: an expert of the first has at most `split`
    rows, so ceil(split / chunk) items; the second's experts have more than `split` rows each, so
    there are at most P // (split + 1) of them, and ceil(c / TILE_M) <= 1 + (c - 1) // TILE_M sums to
    at most that count + P // TILE_M (P = num_tokens * (top_k + 1) sorted rows)."""
    pairs, big = num_tokens * (top_k + 1), expert_gemm.TILE_M
    small = min(work_bound(num_tokens, top_k, num_experts, chunk), (num_experts + 1) * cdiv(split, chunk))
    heavy_experts = min(num_experts + 1, pairs // (split + 1))
    tiled = min(work_bound(num_tokens, top_k, num_experts, big), heavy_experts + pairs // big)
    return small, tiled


def check_logits(logits, bias, top_k: int, ws: MoeRoutingWorkspace, num_tokens) -> tuple[int, int, int]:
    """The router's fp32 logits [M, E] or split-K parts [S, M, E] for this workspace, its bias [E],
    the device token count; (S, M, E)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        raise ValueError("logits must be fp32 [tokens, experts] or split-K parts [parts, tokens, experts]")
    parts, m, e = logits.shape if logits.dim() == 3 else (1, *logits.shape)
    if not 1 <= m <= ws.max_tokens or e != ws.num_experts or top_k != ws.top_k:
        raise ValueError(f"logits [{m}, {e}] with top_k {top_k} do not fit a workspace for "
                         f"{ws.max_tokens} tokens, {ws.num_experts} experts, top_k {ws.top_k}")
    if not 1 <= parts <= MAX_LOGIT_PARTS:
        raise ValueError(f"logits of {parts} split-K parts: at most {MAX_LOGIT_PARTS}")
    check_tensor(logits, "logits", torch.float32, tuple(logits.shape), logits.device, 4)
    check_tensor(bias, "bias", torch.float32, (e,), logits.device, 4)
    if num_tokens is not None:
        check_tensor(num_tokens, "num_tokens", torch.int32, (1,), logits.device, 4)
    return parts, m, e


def routing_views(ws: MoeRoutingWorkspace, m: int, chunk: int) -> Routing:
    """The workspace's views for a call of m tokens in items of `chunk` rows (the main work list)."""
    e, top_k = ws.num_experts, ws.top_k
    if work_bound(m, top_k, e, chunk) > MAX_ITEMS:
        raise ValueError(f"{m} tokens in items of {chunk} rows make more than {MAX_ITEMS} work items")
    pairs = m * (top_k + 1)
    return Routing(ws.ids[:m], ws.weights[:m], ws.offsets, ws.sorted_token[:pairs], ws.pair_row[:m],
                   ws.work_expert, ws.work_row, ws.num_work, e, chunk, work_bound(m, top_k, e, chunk))


def _route(logits, bias, top_k, scaling, ws, num_tokens, pdl, chunk, fused, heavy_first, split):
    parts, m, e = check_logits(logits, bias, top_k, ws, num_tokens)
    chunk = moe_chunk(m, top_k, e) if chunk is None else chunk
    if chunk not in (*CHUNKS, expert_gemm.TILE_M):
        raise ValueError(f"chunk must be one of {(*CHUNKS, expert_gemm.TILE_M)}, got {chunk}")
    big = expert_gemm.TILE_M
    r = routing_views(ws, m, chunk)
    tiled = Routing(r.ids, r.weights, r.offsets, r.sorted_token, r.pair_row, ws.work2_expert, ws.work2_row,
                    ws.num_work2, e, big, work_bound(m, top_k, e, big))
    if split:   # tighter grids: the GEMMs' CTAs past the item count exit, but each takes a slot
        r.max_items, tiled.max_items = split_bounds(m, top_k, e, chunk, split)
    shared = routing_shared_bytes(e)
    sort_args = [ws.queue, r.offsets, r.sorted_token, r.pair_row, r.work_expert, r.work_row, r.num_work,
                 tiled.work_expert, tiled.work_row, tiled.num_work]
    list_args = [I32(chunk), I32(int(heavy_first)), I32(split), I32(big)]
    dev = logits.device.index
    if fused:
        routing_kernel("moe_route", e).launch(
            (cdiv(m, ROUTING_WARPS),), (ROUTING_THREADS,),
            [r.ids, r.weights, *sort_args, ws.ticket, logits, I32(parts), bias, num_tokens, I32(m), I32(e),
             I32(top_k), F32(scaling), *list_args], shared_bytes=shared, pdl=pdl, device=dev)
    else:
        routing_kernel("moe_topk", e).launch(
            (cdiv(m, ROUTING_WARPS),), (ROUTING_THREADS,),
            [r.ids, r.weights, logits, I32(parts), bias, num_tokens, I32(m), I32(e), I32(top_k), F32(scaling)],
            pdl=pdl, device=dev)
        routing_kernel("moe_sort", e).launch(
            (1,), (ROUTING_THREADS,), [*sort_args, r.ids, num_tokens, I32(m), I32(e), I32(top_k), *list_args],
            shared_bytes=shared, pdl=pdl, device=dev)
    return r, tiled


def moe_tiles_per_cta() -> int:
    """The expert GEMMs take 4 tiles per CTA (a warp streams one 16-row tile over all of K) at every
    size: a CTA then moves 4x the bytes for the same fixed cost. Measured on the H200, Flint's MoE
    layer with 1 / 4 tiles (µs): NVFP4 at 16 / 64 / 256 tokens 100.6 / 80.0, 194.1 / 140.1,
    348.4 / 253.6; BF16 118.3 / 123.3, 224.1 / 203.8, 392.4 / 329.1 (benchmarks/RESULTS.md)."""
    return TILES_PER_CTA[1]


def _plan(routing: Routing, num_tiles: int) -> tuple[tuple[int, int], int]:
    per_cta = moe_tiles_per_cta()
    return grid(routing.max_items, num_tiles, per_cta), per_cta


def moe_gate_up_sorted(x: torch.Tensor, routing: Routing, gate: Weight, up: Weight, shared_gate: Weight,
                       shared_up: Weight, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """h_sorted [M * (A + 1), I]: row r = silu(x[t] @ Wg_e^T) * (x[t] @ Wu_e^T), t = sorted_token[r];
    rows past the routed count are not written."""
    m, k = check_rows(x)
    e, i = gate.shape[0], gate.shape[1]
    if e != routing.num_experts or m != routing.pair_row.shape[0]:
        raise ValueError(f"gate has {e} experts / x {m} tokens; routing has {routing.num_experts} / "
                         f"{routing.pair_row.shape[0]}")
    fmt = weight_format(gate, up, shared_gate, shared_up)
    args = moe_gate_up_args(gate, up, shared_gate, shared_up, i, k, e, x.device)
    h = out_buffer(out, "out", (routing.sorted_token.numel(), i), torch.bfloat16, x)
    grid_xy, per_cta = _plan(routing, cdiv(i, TILE_ROWS // 2))
    gemm_kernel("moe_gate_up", fmt, routing.chunk, per_cta).launch(
        grid_xy, (32 * WARPS,), [h, x, routing.sorted_token, *args, *routing.work_args, I32(i), I32(k), I32(e)],
        pdl=pdl, device=x.device.index)
    return h


def moe_down_sorted(h: torch.Tensor, routing: Routing, down: Weight, shared_down: Weight,
                    out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """y_sorted [P, H]: row r = h_sorted[r] @ Wd_e^T (e: the expert of row r, E the shared one)."""
    p, i = check_rows(h, "h")
    e, n = down.shape[0], down.shape[1]
    if e != routing.num_experts or p != routing.sorted_token.numel():
        raise ValueError(f"down has {e} experts / h {p} rows; routing has {routing.num_experts} / "
                         f"{routing.sorted_token.numel()}")
    fmt = weight_format(down, shared_down)
    args = expert_args(down, shared_down, ("down", "shared_down"), n, i, e, h.device)
    y = out_buffer(out, "out", (p, n), torch.bfloat16, h)
    grid_xy, per_cta = _plan(routing, cdiv(n, TILE_ROWS))
    gemm_kernel("moe_down", fmt, routing.chunk, per_cta).launch(
        grid_xy, (32 * WARPS,), [y, h, *args, *routing.work_args, I32(n), I32(i), I32(e)], pdl=pdl,
        device=h.device.index)
    return y


def moe_finalize(y_sorted: torch.Tensor, routing: Routing, residual: torch.Tensor,
                 num_tokens: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 pdl: bool = False, norm_weight: torch.Tensor | None = None,
                 norm_out: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """out [M, H] = bf16(residual + sum_a w[:, a] * y_sorted[pair_row[:, a]] + y_sorted[pair_row[:, A]]);
    tokens t >= num_tokens: residual. out may be residual (in place). With `norm_weight` (bf16 [H]),
    also norm_out = rms_norm(out) * norm_weight (eps `norm_eps`) in the same launch, one CTA a row."""
    m, n = check_rows(residual, "residual")
    if n % 8 or m != routing.pair_row.shape[0]:
        raise ValueError(f"residual must be [{routing.pair_row.shape[0]}, H] with H % 8 == 0, got [{m}, {n}]")
    check_tensor(y_sorted, "y_sorted", torch.bfloat16, (routing.sorted_token.numel(), n), residual.device)
    a = routing.ids.shape[1]
    y = out_buffer(out, "out", (m, n), torch.bfloat16, residual)
    if y.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned")
    args = [y_sorted, routing.pair_row, routing.weights]
    if norm_weight is None:
        routing_kernel("moe_finalize", routing.num_experts).launch(
            (cdiv(m * n // 8, FINALIZE_THREADS),), (FINALIZE_THREADS,),
            [y, residual, *args, num_tokens, I32(m), I32(n), I32(a)], pdl=pdl, device=residual.device.index)
        return y
    if n > MAX_HIDDEN or norm_out is None:
        raise ValueError(f"the fused norm needs norm_out and rows of at most {MAX_HIDDEN} values, got {n}")
    check_tensor(norm_weight, "norm_weight", torch.bfloat16, (n,), residual.device)
    check_tensor(norm_out, "norm_out", torch.bfloat16, (m, n), residual.device, 16)
    routing_kernel("moe_finalize_norm", routing.num_experts).launch(
        (m,), (norm_threads(n),),
        [y, norm_out, residual, *args, norm_weight, num_tokens, I32(m), I32(n), I32(a), F32(norm_eps)],
        pdl=pdl, device=residual.device.index)
    return y


# Tokens from which moe_grouped runs the tiled expert GEMMs. Measured on the H200, Flint's MoE layer
# (benchmarks/bench_grouped.py --pdl --paths swap-ab tiled --tiled-configs w256 w256s5), µs swap-AB /
# tiled: BF16 256: 330 / 283, 512: 469 / 317, 1024: 703 / 380, 8192: 4418 / 1319; NVFP4 256: 245 /
# 363, 512: 388 / 389, 1024: 728 / 484, 8192: 4323 / 1763. The weights of every touched expert are
# read either way; the GEMMs without smem staging of weights or 128-row padding win while rows per
# expert are few and each weight costs an FP4 decode per item: NVFP4 steps below 512 tokens run the
# decode GEMMs of expert_decode.cu, BF16 ones from 256 rows run tiled. (At 512 tokens the decode
# GEMMs won this benchmark, 326 µs against 384 tiled, but in the full model a mixed step of 16
# decodes + 512 prompt rows took 26.1 ms on them against 23.1 on the tiled ones: more experts
# touched than this benchmark's router picks, so more 8-row items, each decoding its weights.)
EXPERT_GEMM_MIN_TOKENS = {"bf16": 256, "nvfp4": 512}
# The router's logits on the GEMV (cuda/gemv.cu gemv_bf16_f32: it loads the gate before waiting on
# the previous launch) up to this many tokens, on cuBLAS / grouped_linear above. Off: alone the GEMV
# takes 4.6 µs against cuBLAS's 6.4 (16 tokens, ncu), but in the full model at 16 requests (16
# warps a CTA) the step took 5.76 ms against 4.97 with cuBLAS (RESULTS.md, session 15), and with
# 4 warps (ROUTER_GEMV_WARPS) 5.8 against 5.0 (session 16).
ROUTER_GEMV_MAX_ROWS = 0
ROUTER_GEMV_WARPS = 4
# Above that, up to ROUTER_SPLIT_MAX_ROWS tokens, the logits are ROUTER_SPLIT_K split-K parts on
# cuBLAS (one batched GEMM over K / S slices of x and the gate, fp32 out), which the routing kernels
# add: cuBLAS alone fills few CTAs with [M, 256] (N = 256 experts) and takes ~5 µs at any M up to
# 256, latency; 8 parts take 2.6-3.3 µs (H200, CUDA graph, 8 gates rotating; RESULTS.md, session
# 23). Past 256 rows (prompt steps) one part.
ROUTER_SPLIT_K = 8
ROUTER_SPLIT_MAX_ROWS = 256
# The decode configs (expert_decode.pick_config) whose gate/up and down GEMMs run as one launch
# (expert_decode.expert_decode_moe: down units fill the gate/up GEMM's last partial wave and start as
# their item's gate/up units finish). Full model, NVFP4, 1K context, ms a step two launches / one
# (benchmarks/ab_decode.py, RESULTS.md session 16): g1t2 16: 5.05 / 5.00, 32: 7.03 / 6.72; g1t4d8
# 48: 7.69 / 7.63, 64: 7.80 / 7.92, 96: 9.85 / 9.67, 128: 11.27 / 11.43; g2w8t4 192: 13.44 / 12.84,
# 256: 15.70 / 14.87. The picks of session 17 (g1t2d4, g2w8t4p) run one launch; g2w8t4p's down
# units take two items of an expert (ED_DOWN_PAIRS), which only the one-launch kernel does.
FUSED_DECODE_CONFIGS = frozenset({"g1t2", "g2w8t4", "g1t2d4", "g2w8t4p", "g1t2d4c"})
# NVFP4 steps of at least HYBRID_MIN_TOKENS tokens split the experts by their rows (route_and_split):
# those of more than HYBRID_SPLIT_ROWS take the tiled GEMMs (each weight decoded once a 128-row tile;
# on the decode GEMMs once an item of 8-16 rows), the others the decode GEMMs (no tile of 128 rows
# padded around a few). Both write their own rows of the same h / y buffers. Not by token count:
# full model, NVFP4, split 32 (RESULTS.md, session 18), it takes 10-19 % off mixed steps of 64-256
# decodes + 1,024 prompt rows and 2.7 % off 256 + 7,936, but adds 16 % to a lone 1K prompt, 2 % to
# an 8K one, and 25-65 % to decode-only steps (the tiled GEMMs' few long CTAs): it wants the step's
# composition, which moe_grouped does not see, so the CUDA executor asks for it (gemms="hybrid")
# for mixed steps (executor/moe_gemms.py HYBRID_MIXED_MIN_ROWS).
HYBRID_MIN_TOKENS = 1 << 30
# Decode-GEMM steps of up to this many tokens whose config runs clusters (expert_decode.routes_in_cluster)
# route inside the expert kernel (expert_decode.expert_decode_moe_routed: no moe_route launch between
# the router's logits and the experts); 0: never.
CLUSTER_ROUTE_MAX_TOKENS = 16
HYBRID_SPLIT_ROWS = 32
GEMMS = ("swap-ab", "decode", "tiled", "hybrid")


def expert_gemms(num_tokens: int, fmt: str, hidden: int, inter: int, gemms: str | None = None) -> str:
    """The expert GEMMs moe_grouped runs: "hybrid" (both below, split by rows an expert) from
    HYBRID_MIN_TOKENS tokens on, else "tiled" (cuda/expert_gemm.cu) from EXPERT_GEMM_MIN_TOKENS[fmt]
    tokens on, below that "decode" (cuda/expert_decode.cu, NVFP4) or "swap-ab" (cuda/grouped_gemm.cu,
    BF16); `gemms` forces one, where the shapes fit it (else "swap-ab", which takes any)."""
    if gemms is not None and gemms not in GEMMS:
        raise ValueError(f"gemms must be one of {GEMMS}, got {gemms!r}")
    tiled = expert_gemm.supported(fmt, hidden, inter)
    decode = expert_decode.supported(fmt, hidden, inter)
    if gemms is None:
        if tiled and decode and num_tokens >= HYBRID_MIN_TOKENS:
            return "hybrid"
        return "tiled" if tiled and num_tokens >= EXPERT_GEMM_MIN_TOKENS[fmt] else "decode" if decode else "swap-ab"
    available = {"tiled": tiled, "decode": decode, "hybrid": tiled and decode, "swap-ab": True}
    return gemms if available[gemms] else "swap-ab"


def moe_grouped(x: torch.Tensor, router_gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                gate: Weight, up: Weight, down: Weight, shared_gate: Weight, shared_up: Weight,
                shared_down: Weight, residual: torch.Tensor, workspace: MoeRoutingWorkspace,
                out: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None,
                pdl: bool = False, gemms: str | None = None, norm_weight: torch.Tensor | None = None,
                norm_out: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """The MoE block plus residual for x bf16 [M, H]: five launches, no host sync. The workspace
    needs hidden_size and intermediate_size (its h/y buffers). `gemms`: see expert_gemms. With
    `norm_weight`, norm_out also receives the result's RMSNorm (moe_finalize)."""
    ws = workspace
    m, hidden = check_rows(x)
    inter = gate.shape[1]
    if ws.h_sorted is None or ws.y_sorted is None or ws.h_sorted.shape[1] != inter or ws.y_sorted.shape[1] != hidden:
        raise ValueError(f"the workspace needs h/y buffers for intermediate {inter}, hidden {hidden}: "
                         "moe_routing_workspace(..., hidden_size=, intermediate_size=)")
    check_tensor(router_gate, "router_gate", torch.bfloat16, (ws.num_experts, hidden), x.device)
    pairs = m * (top_k + 1)
    logits = router_logits(x, router_gate, ws, pdl)
    path = expert_gemms(m, weight_format(gate), hidden, inter, gemms)
    h_out, y_out = ws.h_sorted[:pairs], ws.y_sorted[:pairs]
    if path == "hybrid":   # the tiled GEMMs over the heavy experts first, the decode GEMMs then write the rest
        config = expert_decode.pick_config(m, hidden, inter)
        routing, tiled = route_and_split(logits, bias, top_k, scaling, ws, expert_decode.rows_per_item(config),
                                         HYBRID_SPLIT_ROWS, num_tokens=num_tokens, pdl=pdl)
        # One after the other: on a side stream beside the tiled GEMMs, a 1K prompt lost 4 % instead
        # of 14 %, but 256 decodes + 1,024 prompt rows took 48.9 ms instead of 36.8 (RESULTS.md,
        # session 18)
        if tiled.max_items:   # else no expert can have more than split rows
            h = expert_gemm.expert_gate_up(x, tiled, gate, up, shared_gate, shared_up, out=h_out, pdl=pdl)
            expert_gemm.expert_down(h, tiled, down, shared_down, out=y_out, pdl=pdl)
        y = _decode_gemms(x, routing, ws.queue, config, gate, up, shared_gate, shared_up, down, shared_down,
                          h_out, y_out, pdl)
    elif path == "decode":
        config = expert_decode.pick_config(m, hidden, inter)
        if m <= CLUSTER_ROUTE_MAX_TOKENS and expert_decode.routes_in_cluster(config, m, ws.num_experts, top_k,
                                                                             hidden, inter):
            check_logits(logits, bias, top_k, ws, num_tokens)
            routing = routing_views(ws, m, expert_decode.rows_per_item(config))
            y = expert_decode.expert_decode_moe_routed(x, logits, bias, top_k, scaling, routing, num_tokens, gate, up,
                                                       shared_gate, shared_up, down, shared_down, h_out, out=y_out,
                                                       pdl=pdl, config=config)
        else:
            routing = route_and_sort(logits, bias, top_k, scaling, ws, num_tokens=num_tokens, pdl=pdl,
                                     chunk=expert_decode.rows_per_item(config))
            y = _decode_gemms(x, routing, ws.queue, config, gate, up, shared_gate, shared_up, down, shared_down,
                              h_out, y_out, pdl)
    else:
        tiled_path = path == "tiled"
        routing = route_and_sort(logits, bias, top_k, scaling, ws, num_tokens=num_tokens, pdl=pdl,
                                 chunk=expert_gemm.TILE_M if tiled_path else None)
        gate_up_gemm, down_gemm = ((expert_gemm.expert_gate_up, expert_gemm.expert_down) if tiled_path
                                   else (moe_gate_up_sorted, moe_down_sorted))
        h = gate_up_gemm(x, routing, gate, up, shared_gate, shared_up, out=h_out, pdl=pdl)
        y = down_gemm(h, routing, down, shared_down, out=y_out, pdl=pdl)
    return moe_finalize(y, routing, residual, num_tokens=num_tokens, out=out, pdl=pdl, norm_weight=norm_weight,
                        norm_out=norm_out, norm_eps=norm_eps)


def router_logits(x: torch.Tensor, router_gate: torch.Tensor, ws: MoeRoutingWorkspace,
                  pdl: bool = False) -> torch.Tensor:
    """fp32 logits of x bf16 [M, H] against the router's gate bf16 [E, H]: [M, E] (the GEMV up to
    ROUTER_GEMV_MAX_ROWS rows, else grouped_linear), or [S, M, E] split-K parts up to
    ROUTER_SPLIT_MAX_ROWS rows (route_and_sort adds them)."""
    m, e = x.shape[0], router_gate.shape[0]
    if m <= ROUTER_GEMV_MAX_ROWS:
        return linear(x, router_gate, out=ws.logits[:m], out_dtype=torch.float32, pdl=pdl, warps=ROUTER_GEMV_WARPS)
    s = ROUTER_SPLIT_K
    if s <= MAX_LOGIT_PARTS and m <= ROUTER_SPLIT_MAX_ROWS and s * m * e <= ws.logit_parts.numel():
        parts = mm_f32_parts(x, router_gate, s, out=ws.logit_parts[:s * m * e].view(s, m, e))
        if parts is not None:
            return parts
    return grouped_linear(x, router_gate, out=ws.logits[:m], out_dtype=torch.float32, pdl=pdl)


def _decode_gemms(x, routing, queue, config, gate, up, shared_gate, shared_up, down, shared_down, h_out, y_out, pdl):
    """The decode GEMMs of config over the routing's work list into h_out / y_out, in one launch where
    the config has it (FUSED_DECODE_CONFIGS: `queue` its unit counters); y_sorted."""
    if config in FUSED_DECODE_CONFIGS:
        return expert_decode.expert_decode_moe(x, routing, queue, gate, up, shared_gate, shared_up, down,
                                               shared_down, h_out, out=y_out, pdl=pdl, config=config)
    h = expert_decode.expert_decode_gate_up(x, routing, gate, up, shared_gate, shared_up, out=h_out, pdl=pdl,
                                            config=config)
    return expert_decode.expert_decode_down(h, routing, down, shared_down, out=y_out, pdl=pdl, config=config)
