"""Tiled expert GEMMs for large token counts (cuda/expert_gemm.cu): the grouped MoE's gate/up and
down over rows sorted by expert, in M-tiles of TILE_M rows taken from a routing work list built
with chunk=TILE_M (`route_and_sort(..., chunk=TILE_M)`), so nothing leaves the GPU and a call can
be captured in a CUDA graph. Same inputs and outputs as moe_gate_up_sorted / moe_down_sorted.

CONFIGS: EG_BN weight rows per CTA and the cp.async ring depth; `pick_config` chooses per format.
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels import _runtime
from flint_sched.kernels._runtime import I32, Kernel, compile_kernel
from flint_sched.kernels.grouped import MAX_GRID_Y, check_work_list
from flint_sched.kernels.linear import Weight, cdiv, check_tensor, expert_args, moe_gate_up_args, weight_format
from flint_sched.quant.nvfp4 import NVFP4Tensor

TILE_M = 128        # rows per M-tile (cuda/expert_gemm.cu EG_BM) = the routing chunk
TILE_K = 64         # EG_BK: K must be a multiple

# name -> compile-time defines. "n256": 8 warps, 128 x 256 CTA tile, 1 CTA per SM; "n128": 4 warps,
# 128 x 128, 2 CTAs per SM (3 stages: 96 KB BF16, 95 KB NVFP4), both on mma.sync; "w256", "w256s5":
# the n256 tile on warpgroup MMAs (wgmma, sm_90a), 4 or 5 stages (5 fit NVFP4 only). Measured on the
# H200, Flint's MoE layer (benchmarks/bench_grouped.py --pdl --paths tiled --tiled-configs ...), µs
# at 1K / 4K / 8K tokens: BF16 n128 449 / 934 / 1591, w256 386 / 760 / 1313; NVFP4 n128 636 / 1280 /
# 2195, w256 477 / 984 / 1676, w256s5 467 / 973 / 1644 (RESULTS.md, session 7).
CONFIGS = {
    "n256": {"EG_BN": 256, "EG_STAGES": 4, "EG_MIN_CTAS": 1},
    "n128": {"EG_BN": 128, "EG_STAGES": 3, "EG_MIN_CTAS": 2},
    "w256": {"EG_BN": 256, "EG_STAGES": 4, "EG_MIN_CTAS": 1, "EG_WGMMA": 1},
    "w256s5": {"EG_BN": 256, "EG_STAGES": 5, "EG_MIN_CTAS": 1, "EG_WGMMA": 1},
    # the same, items of <= 64 rows on swap-AB tiles (m64n16/32/64 with the weights as A)
    "w256x": {"EG_BN": 256, "EG_STAGES": 4, "EG_MIN_CTAS": 1, "EG_WGMMA": 1, "EG_SWAP": 1},
    "w256s5x": {"EG_BN": 256, "EG_STAGES": 5, "EG_MIN_CTAS": 1, "EG_WGMMA": 1, "EG_SWAP": 1},
    # 512 threads (16 warps a SM; ncu: the 8-warp NVFP4 tiles issue 0.30 instructions a cycle per
    # scheduler at 528 tokens, no warp eligible 70 % of the time), every item on swap-AB tiles of up to
    # 128 rows, 4 stages; NVFP4 only. The default: 1-4 % faster than w256s5 in every tiled case of the
    # full model (mixed steps of 512-2,032 prompt rows, 8K prefill 69.5K -> 71.5K tok/s; RESULTS.md
    # session 11)
    "s512": {"EG_BN": 256, "EG_STAGES": 4, "EG_MIN_CTAS": 1, "EG_WGMMA": 1, "EG_SWAP": 1, "EG_WIDE": 1},
}
DEFAULT_CONFIG = {"bf16": "w256", "nvfp4": "s512"}


MAX_SHARED_BYTES = 227 * 1024   # sm_90's opt-in dynamic shared memory per block


def formats(config: str) -> tuple[str, ...]:
    """Weight formats whose shared memory the config fits (five BF16 stages of 48 KB do not)."""
    wide = CONFIGS[config].get("EG_WIDE", 0)
    return tuple(fmt for fmt in ("bf16", "nvfp4")
                 if shared_bytes(fmt, config) <= MAX_SHARED_BYTES and not (wide and fmt == "bf16"))


@functools.cache
def _kernel(name: str, config: str) -> Kernel:
    return compile_kernel("expert_gemm.cu", name, CONFIGS[config])


def shared_bytes(fmt: str, config: str) -> int:
    """Dynamic shared memory: the ring of A [128 x 128 B] + B tiles; NVFP4 stages hold codes and
    scales ([BN x 36 B]) and add two (wgmma: three) decoded bf16 B tiles and the 1 KB scale table."""
    c = CONFIGS[config]
    bn, stages = c["EG_BN"], c["EG_STAGES"]
    stage = TILE_M * 128 + (bn * 128 if fmt == "bf16" else bn * 36)
    if c.get("EG_WGMMA"):   # 1 KB-aligned tiles (stages padded, 1 KB to align the base), 3 decoded tiles
        stage = cdiv(stage, 1024) * 1024
        return 1024 + stages * stage + (0 if fmt == "bf16" else 3 * bn * 128 + 1024)
    return stages * stage + (0 if fmt == "bf16" else 2 * bn * 128 + 1024)


def threads(config: str) -> int:
    return 512 if CONFIGS[config].get("EG_WIDE") else CONFIGS[config]["EG_BN"]


def supported(fmt: str, hidden: int, inter: int) -> bool:
    """Shapes the tiles cover exactly: K (hidden for gate/up, inter for down) a multiple of 64,
    I a multiple of BN / 2 and hidden a multiple of BN for every config."""
    bn = max(c["EG_BN"] for c in CONFIGS.values())
    return hidden % TILE_K == 0 and inter % TILE_K == 0 and inter % (bn // 2) == 0 and hidden % bn == 0


def _config(fmt: str, config: str | None) -> str:
    if config is None:   # wgmma is sm_90a's alone: other GPUs take the mma.sync tile
        config = DEFAULT_CONFIG[fmt] if _runtime.current_arch() == "sm_90a" else "n128"
    if fmt not in formats(config):
        raise ValueError(f"expert GEMM config {config} does not fit {fmt} weights")
    return config


def _check_routing(routing, rows_needed: int, num_experts: int) -> None:
    check_work_list(routing, TILE_M, rows_needed, num_experts, "expert_gemm (the tiled expert GEMMs)")
    if routing.max_items > MAX_GRID_Y:
        raise ValueError(f"{routing.max_items} work items exceed grid y ({MAX_GRID_Y})")


def _out(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=like.device)
    check_tensor(out, "out", torch.bfloat16, shape, like.device, 4)
    return out


def _check_scales(*weights: Weight) -> None:
    for w in weights:   # the kernels copy 4 scale bytes per row and k-tile
        if isinstance(w, NVFP4Tensor) and w.block_scales.data_ptr() % 4:
            raise ValueError("NVFP4 block scales must be 4-byte aligned for the expert GEMMs")


def expert_gate_up(x: torch.Tensor, routing, gate: Weight, up: Weight, shared_gate: Weight, shared_up: Weight,
                   out: torch.Tensor | None = None, pdl: bool = False, config: str | None = None) -> torch.Tensor:
    """h_sorted [P, I]: row r = silu(x[t] @ Wg_e^T) * (x[t] @ Wu_e^T), t = sorted_token[r], e the
    expert of row r (E: shared_gate / shared_up); rows past the routed count are not written."""
    m, k = x.shape
    e, i = gate.shape[0], gate.shape[1]
    check_tensor(x, "x", torch.bfloat16, (m, k), x.device)
    _check_routing(routing, routing.sorted_token.numel(), e)
    if routing.pair_row.shape[0] != m:
        raise ValueError(f"x has {m} tokens, routing {routing.pair_row.shape[0]}")
    fmt = weight_format(gate, up, shared_gate, shared_up)
    config = _config(fmt, config)
    bn = CONFIGS[config]["EG_BN"]
    if k % TILE_K or i % (bn // 2):
        raise ValueError(f"expert_gate_up needs K % {TILE_K} == 0 and I % {bn // 2} == 0, got K {k}, I {i}")
    _check_scales(gate, up, shared_gate, shared_up)
    args = moe_gate_up_args(gate, up, shared_gate, shared_up, i, k, e, x.device)
    h = _out(out, (routing.sorted_token.numel(), i), x)
    _kernel(f"expert_gate_up_{fmt}", config).launch(
        (i // (bn // 2), routing.max_items), (threads(config),),
        [h, x, routing.sorted_token, *args, *routing.work_args, I32(i), I32(k), I32(e)],
        shared_bytes=shared_bytes(fmt, config), pdl=pdl, device=x.device.index)
    return h


def expert_down(h: torch.Tensor, routing, down: Weight, shared_down: Weight, out: torch.Tensor | None = None,
                pdl: bool = False, config: str | None = None) -> torch.Tensor:
    """y_sorted [P, N]: row r = h_sorted[r] @ Wd_e^T (e: the expert of row r, E the shared one)."""
    p, k = h.shape
    e, n = down.shape[0], down.shape[1]
    check_tensor(h, "h", torch.bfloat16, (p, k), h.device)
    _check_routing(routing, p, e)
    fmt = weight_format(down, shared_down)
    config = _config(fmt, config)
    bn = CONFIGS[config]["EG_BN"]
    if k % TILE_K or n % bn:
        raise ValueError(f"expert_down needs K % {TILE_K} == 0 and N % {bn} == 0, got K {k}, N {n}")
    _check_scales(down, shared_down)
    args = expert_args(down, shared_down, ("down", "shared_down"), n, k, e, h.device)
    y = _out(out, (p, n), h)
    _kernel(f"expert_down_{fmt}", config).launch(
        (cdiv(n, bn), routing.max_items), (threads(config),),
        [y, h, *args, *routing.work_args, I32(n), I32(k), I32(e)],
        shared_bytes=shared_bytes(fmt, config), pdl=pdl, device=h.device.index)
    return y
