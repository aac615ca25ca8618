"""Skinny GEMMs for decode (cuda/gemv.cu): y = x @ W^T (+ residual) and silu(x @ Wg^T) * (x @ Wu^T).

x [B, K] bf16 contiguous with B <= 32 (GEMV_MAX_TOKENS; the small-batch MoE and router take <= 8,
MAX_TOKENS); W bf16 [N, K] (K % 8 == 0) or an NVFP4Tensor (K % 64 == 0); outputs bf16. One CTA per
16 output rows (8 for gate/up: Wg and Wu stay separate tensors, their rows share one tile), whole K
per CTA, 4-16 warps splitting K (`gemv_warps`); every 8 tokens past the first 8 are one more mma
column group fed by the same decoded weights (GEMV_GROUPS 1-4); with out_dtype fp32 (bf16 W, no
residual) y is fp32: the router's logits. `out` may be
`residual` (in-place add). `concat_rows` stacks up to three weights for one GEMV (q, k and v);
NVFP4 parts keep their own tensor scales.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.hardware import sm_count
from flint_sched.quant.nvfp4 import NVFP4Tensor

MAX_TOKENS = 8          # one 8-token mma column group: the small-batch MoE's and router's limit
GEMV_MAX_TOKENS = 32    # the GEMVs: four groups
TILE_ROWS = 16
K_STEP = {"bf16": 32, "nvfp4": 128}  # weights per row per warp k-step (cuda/gemv_tile.cuh)
UNROLL = {"bf16": 8, "nvfp4": 4}     # k-steps a warp loads at once (cuda/gemv.cu)
# NOTE: ~32 KB of loads in flight per SM keep HBM busy; one warp has 4-8 KB in flight, so aim
# for ~16 resident warps per SM over the grid.
WARPS_PER_SM = 16
# Registers a thread of cuda/gemv.cu's builds by (format, groups): ptxas's most over the warp counts
# gemv_warps may pick, rounded up to the allocation unit of 8 (tests/test_kernels_compile.py checks
# them against the builds). With NVFP4 at two groups taken as one (80 for 102), q/k/v at 9-16 tokens
# ran 320 CTAs of 8 warps on 264 slots: 8.9 µs against 4.3 at 8 tokens (RESULTS.md, session 22).
REGISTERS = {("bf16", 1): 128, ("bf16", 2): 128, ("bf16", 3): 152, ("bf16", 4): 160,
             ("nvfp4", 1): 88, ("nvfp4", 2): 104, ("nvfp4", 3): 136, ("nvfp4", 4): 144}
REGISTER_UNIT = 8
MAX_THREADS_PER_SM = 2048

Weight = torch.Tensor | NVFP4Tensor


def x_batch(fmt: str) -> int:
    """X_BATCH of cuda/gemv_tile.cuh: BF16 loads a round's activations together; NVFP4 loads each
    next to its mma (~80 instead of ~130 registers: more CTAs per SM for the FP4 decode's integer
    work). Measured on the H200, NVFP4 batch 1/2/4/8 at 1K: 2.24/2.55/3.20/4.54 ms per step with
    X_BATCH 0, 2.27/2.68/3.40/4.88 with 1 (benchmarks/RESULTS.md)."""
    return int(fmt == "bf16")


@functools.cache
def _kernel(name: str, warps: int, batch_x: int, groups: int = 1, extra: tuple = ()) -> Kernel:
    return compile_kernel("gemv.cu", name, {"GEMV_WARPS": warps, "X_BATCH": batch_x, "GEMV_GROUPS": groups,
                                            **dict(extra)})


def groups(tokens: int) -> int:
    """8-token mma column groups of a GEMV of `tokens` rows (GEMV_GROUPS)."""
    return cdiv(tokens, MAX_TOKENS)


def resident_ctas(warps: int, fmt: str, num_groups: int = 1) -> int:
    """CTAs of `warps` warps that fit on the GPU at once, by registers (REGISTERS) and threads."""
    per_sm = min(65536 // (32 * warps * REGISTERS[fmt, num_groups]), MAX_THREADS_PER_SM // (32 * warps))
    return sm_count() * max(1, per_sm)


def gemv_warps(tiles: int, k: int, fmt: str, num_groups: int = 1) -> int:
    """Warps per CTA (4, 8 or 16; at most 8 with 3-4 groups, whose registers would spill at 16):
    more while the grid is small or a warp would need a second round of loads, never more than
    the k-steps, and never so many that a grid fitting one wave of CTAs would need two (measured
    on the H200: benchmarks/bench_kernels.py). The last rule keeps BF16 q/k/v (320 tiles, K = 2048)
    at 4 warps: with 8 (2 CTAs per SM) it spanned 1.2 waves; batch 8 at 1K went from ~6.5 to
    ~6.35 ms per step, batch 1 did not move (benchmarks/RESULTS.md)."""
    steps = cdiv(k, K_STEP[fmt])
    most = 16 if num_groups <= 2 else 8
    warps = 4
    while (warps < most and 2 * warps <= steps
           and (tiles * warps < WARPS_PER_SM * sm_count() or steps > warps * UNROLL[fmt])
           and not resident_ctas(2 * warps, fmt, num_groups) < tiles <= resident_ctas(warps, fmt, num_groups)):
        warps *= 2
    return warps


def check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 device: torch.device, align: int = 16) -> None:
    """Shape, dtype, device, contiguity and base alignment (bytes), with a message naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address")


def check_activations(x: torch.Tensor, name: str = "x", max_tokens: int = MAX_TOKENS) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [tokens, features]")
    if not x.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    if not 1 <= x.shape[0] <= max_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens; these kernels take 1..{max_tokens}")
    check_tensor(x, name, torch.bfloat16, tuple(x.shape), x.device)


def weight_args(w: Weight, name: str, shape: tuple[int, ...], device: torch.device,
                num_scales: int = 1) -> list:
    """Kernel arguments of a bf16 or NVFP4 weight [..., N, K], checked: [w] or [codes, scales, scale]."""
    *lead, n, k = shape
    if isinstance(w, NVFP4Tensor):
        if k % 64:
            raise ValueError(f"{name}: NVFP4 needs K % 64 == 0, got K = {k}")
        check_tensor(w.codes, f"{name}.codes", torch.uint8, (*lead, n, k // 2), device)
        check_tensor(w.block_scales, f"{name}.block_scales", torch.uint8, (*lead, n, k // 16), device, 2)
        check_tensor(w.tensor_scale, f"{name}.tensor_scale", torch.float32, (num_scales,), device, 4)
        return [w.codes, w.block_scales, w.tensor_scale]
    if k % 8:
        raise ValueError(f"{name}: bf16 weights need K % 8 == 0, got K = {k}")
    check_tensor(w, name, torch.bfloat16, shape, device)
    return [w]


def expert_args(stack: Weight, shared: Weight, names: tuple[str, str], rows: int, k: int, num_experts: int,
                device: torch.device) -> list:
    """Kernel arguments of an expert stack [E, rows, k] (one tensor scale per expert) and the shared
    expert's weight [rows, k], checked."""
    return (weight_args(stack, names[0], (num_experts, rows, k), device, num_experts)
            + weight_args(shared, names[1], (rows, k), device))


def moe_gate_up_args(gate: Weight, up: Weight, shared_gate: Weight, shared_up: Weight, rows: int, k: int,
                     num_experts: int, device: torch.device) -> list:
    """The MoE gate/up kernels' weight arguments, in their order: gate, up, shared gate, shared up
    (each [w], or [codes, scales, tensor scale] for NVFP4)."""
    gates = expert_args(gate, shared_gate, ("gate", "shared_gate"), rows, k, num_experts, device)
    ups = expert_args(up, shared_up, ("up", "shared_up"), rows, k, num_experts, device)
    n = len(gates) // 2
    return gates[:n] + ups[:n] + gates[n:] + ups[n:]


def weight_format(*weights: Weight | None) -> str:
    """'nvfp4' or 'bf16'; every given weight must use the same one."""
    kinds = {isinstance(w, NVFP4Tensor) for w in weights if w is not None}
    if len(kinds) > 1:
        raise ValueError("mixing NVFP4 and bf16 weights in one kernel is not supported")
    return "nvfp4" if kinds == {True} else "bf16"


def output(out: torch.Tensor | None, name: str, shape: tuple[int, ...], like: torch.Tensor,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(out, name, dtype, shape, like.device, dtype.itemsize)
    return out


MAX_ROW_PARTS = 3


def concat_rows(weights: Sequence[Weight]) -> tuple[Weight, tuple[int, ...]]:
    """[W0; W1; ...] (same K, same format, at most three) as one weight, and the rows where W1, W2...
    start: pass them to `linear` as `row_splits`. NVFP4 parts keep their tensor scales, one each."""
    if not 1 <= len(weights) <= MAX_ROW_PARTS:
        raise ValueError(f"concat_rows takes 1..{MAX_ROW_PARTS} weights, got {len(weights)}")
    if len({w.shape[1:] for w in weights}) != 1 or any(len(w.shape) != 2 for w in weights):
        raise ValueError(f"weights must be 2-D with one K, got {[tuple(w.shape) for w in weights]}")
    fmt = weight_format(*weights)
    starts, row = [], 0
    for w in weights[:-1]:
        row += w.shape[0]
        starts.append(row)
    if fmt == "bf16":
        return torch.cat(list(weights)).contiguous(), tuple(starts)
    if any(w.tensor_scale.numel() != 1 for w in weights):
        raise ValueError("concat_rows takes NVFP4 weights with one tensor scale each")
    return NVFP4Tensor(torch.cat([w.codes for w in weights]).contiguous(),
                       torch.cat([w.block_scales for w in weights]).contiguous(),
                       torch.cat([w.tensor_scale.reshape(1) for w in weights])), tuple(starts)


def check_row_splits(row_splits: tuple[int, ...], n: int) -> None:
    if len(row_splits) >= MAX_ROW_PARTS or list(row_splits) != sorted(set(row_splits)) or any(
            not 0 < r < n for r in row_splits):
        raise ValueError(f"row_splits must be at most {MAX_ROW_PARTS - 1} increasing rows inside 1..{n - 1}, "
                         f"got {row_splits}")


def linear(x: torch.Tensor, weight: Weight, residual: torch.Tensor | None = None,
           out: torch.Tensor | None = None, pdl: bool = False, row_splits: tuple[int, ...] = (),
           out_dtype: torch.dtype = torch.bfloat16, warps: int | None = None,
           norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
           argmax_out: torch.Tensor | None = None, argmax_workspace: torch.Tensor | None = None,
           argmax_active: torch.Tensor | None = None) -> torch.Tensor:
    """y[B, N] = x @ W^T (+ residual), fp32 sums, one bf16 rounding. `row_splits`: from `concat_rows`.
    out_dtype fp32 (bf16 W, no residual): y unrounded, the router's logits. `warps`: per CTA (4, 8
    or 16), else `gemv_warps`. norm_weight [K]: y = rms_norm(x, norm_weight, norm_eps) @ W^T in the
    same launch (cuda/gemv.cu's NORM: bf16 roundings differ from the norm's own launch).
    argmax_out [B] int32 / int64 (the LM head; bf16 y, no residual, norm or row splits): also
    argmax_out[b] = argmax of y[b] as stored, torch.argmax's choice, in the same launch
    (kernels/sampling.py pick_workspace: zeroed once, left zeroed by each launch). argmax_active:
    int32 [1]; where it holds 0 when the kernel runs, only y is written (sampling.greedy's `active`)."""
    check_activations(x, max_tokens=GEMV_MAX_TOKENS)
    b, k = x.shape
    n = weight.shape[0]
    if tuple(weight.shape) != (n, k):
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    check_row_splits(row_splits, n)
    w_args = weight_args(weight, "weight", (n, k), x.device, len(row_splits) + 1)
    if residual is not None:
        check_tensor(residual, "residual", torch.bfloat16, (b, n), x.device, 2)
    fmt = weight_format(weight)
    f32 = out_dtype == torch.float32
    if out_dtype not in (torch.bfloat16, torch.float32) or f32 and (fmt != "bf16" or residual is not None
                                                                      or row_splits):
        raise ValueError("linear writes bf16, or fp32 from one bf16 weight without a residual")
    if norm_weight is not None:
        if f32:
            raise ValueError("a folded norm writes bf16")
        check_tensor(norm_weight, "norm_weight", torch.bfloat16, (k,), x.device)
    pick = [] if argmax_out is None else pick_args(argmax_out, argmax_workspace, argmax_active, b, x.device)
    if pick and (f32 or residual is not None or row_splits or norm_weight is not None):
        raise ValueError("the folded argmax takes a bf16 GEMV without residual, row splits or norm")
    y = output(out, "out", (b, n), x, out_dtype)
    tiles, num_groups = cdiv(n, TILE_ROWS), groups(b)
    if warps not in (None, 4, 8, 16) or warps == 16 and num_groups > 2:
        raise ValueError(f"warps must be 4, 8 or 16 (at most 8 past 16 tokens), got {warps}")
    warps = warps or gemv_warps(tiles, k, fmt, num_groups)
    splits = [I32(r) for r in (*row_splits, n, n)[:2]] if fmt == "nvfp4" else []
    args = ([y, x, *w_args, I32(b), I32(n), I32(k)] if f32 else
            [y, x, *w_args, residual, I32(b), I32(n), I32(k), *splits])
    name = "gemv_bf16_f32" if f32 else f"gemv_{fmt}"
    if norm_weight is not None:
        name, args = name + "_norm", [*args, norm_weight, F32(norm_eps)]
    extra = ()
    if pick:
        name, args = name + "_argmax", [y, x, *w_args, I32(b), I32(n), I32(k), *pick]
        extra = tickets.defines()
    _kernel(name, warps, x_batch(fmt), num_groups, extra).launch((tiles,), (32 * warps,), args, pdl=pdl,
                                                          device=x.device.index)
    return y


def pick_args(ids: torch.Tensor, workspace: torch.Tensor | None, active: torch.Tensor | None, b: int,
              device: torch.device) -> list:
    """The folded argmax's kernel arguments (best, ticket, ids, ids are int64, active), checked."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("argmax_out must be an int32 or int64 tensor")
    check_tensor(ids, "argmax_out", ids.dtype, (b,), device, ids.element_size())
    if (not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int64 or workspace.dim() != 1
            or workspace.numel() < b + 1):
        raise ValueError(f"argmax_workspace must be int64 with >= {b + 1} elements (sampling.pick_workspace)")
    check_tensor(workspace, "argmax_workspace", torch.int64, (workspace.numel(),), device, 8)
    if active is not None:
        check_tensor(active, "argmax_active", torch.int32, (1,), device, 4)
    return [workspace, workspace[workspace.numel() - 1:], ids, I32(ids.dtype == torch.int64), active]


def gate_up_args(gate: Weight, up: Weight, k: int, device: torch.device) -> tuple[int, str, list]:
    """(I, format, kernel arguments) of a gate/up pair, both [I, K] in one format, checked."""
    i = gate.shape[0]
    for name, w in (("gate", gate), ("up", up)):
        if tuple(w.shape) != (i, k):
            raise ValueError(f"{name} must be [{i}, {k}], got {tuple(w.shape)}")
    fmt = weight_format(gate, up)
    return i, fmt, weight_args(gate, "gate", (i, k), device) + weight_args(up, "up", (i, k), device)


def gate_up_silu(x: torch.Tensor, gate: Weight, up: Weight, out: torch.Tensor | None = None,
                 pdl: bool = False) -> torch.Tensor:
    """h[B, I] = silu(x @ gate^T) * (x @ up^T); gate and up [I, K] in the same format."""
    check_activations(x, max_tokens=GEMV_MAX_TOKENS)
    b, k = x.shape
    i, fmt, args = gate_up_args(gate, up, k, x.device)
    h = output(out, "out", (b, i), x)
    tiles, num_groups = cdiv(i, TILE_ROWS // 2), groups(b)
    warps = gemv_warps(tiles, k, fmt, num_groups)
    _kernel(f"gate_up_{fmt}", warps, x_batch(fmt), num_groups).launch(
        (tiles,), (32 * warps,), [h, x, *args, I32(b), I32(i), I32(k)], pdl=pdl, device=x.device.index)
    return h


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
