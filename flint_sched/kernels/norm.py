"""RMSNorm launchers (cuda/rmsnorm.cu): plain, and fused with the residual add (bf16, fp32 or
fixed-point x).

x [..., H] bf16 contiguous, H % 8 == 0 and H <= 8192; fp32 math as `rms_norm` in
model/reference.py; one CTA per row. In place is allowed: out may be x, residual_out may be residual.
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.linear import check_tensor

MAX_THREADS = 256
MAX_VEC_PER_THREAD = 4  # cuda/rmsnorm.cu NORM_MAX_VEC
MAX_HIDDEN = 8 * MAX_VEC_PER_THREAD * MAX_THREADS
MAX_PARTS = 4           # cuda/rmsnorm.cu MAX_NORM_PARTS: split-K parts add_rms_norm_f32 adds


@functools.cache
def _kernel(name: str = "rmsnorm_bf16") -> Kernel:
    return compile_kernel("rmsnorm.cu", name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """out = x * rsqrt(mean(x²) + eps) * weight, per row."""
    out = _like(x, out, "out")
    _launch(out, None, x, None, weight, eps, pdl)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) with s = bf16(x + residual)."""
    check_tensor(residual, "residual", torch.bfloat16, tuple(x.shape), x.device)
    out = _like(x, out, "out")
    residual_out = _like(x, residual_out, "residual_out")
    _launch(out, residual_out, x, residual, weight, eps, pdl)
    return out, residual_out


def add_rms_norm_f32(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                     pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) with s = bf16(x + residual) for x fp32 (a GEMM's fp32 product:
    the sum rounded once, as torch.add(x, residual, out=bf16)); residual_out may be residual.
    x may be split-K partial products [parts, *residual.shape] (parts <= MAX_PARTS), added in order."""
    parts = x.shape[0] if x.dim() == residual.dim() + 1 else 1
    if not 1 <= parts <= MAX_PARTS:
        raise ValueError(f"x of {parts} split-K parts: at most {MAX_PARTS}")
    check_tensor(residual, "residual", torch.bfloat16, tuple(x.shape[x.dim() - residual.dim():]), x.device)
    out = _like(residual, out, "out")
    residual_out = _like(residual, residual_out, "residual_out")
    _launch(out, residual_out, x, residual, weight, eps, pdl, "add_rmsnorm_f32", parts)
    return out, residual_out


def add_rms_norm_fixed(acc: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_f32 for a fixed-point sum (int64 of value x 2^32: kernels/moe.py `moe_split`),
    which is zeroed once read, ready for the next sum."""
    check_tensor(residual, "residual", torch.bfloat16, tuple(acc.shape), acc.device)
    out = _like(residual, out, "out")
    residual_out = _like(residual, residual_out, "residual_out")
    _launch(out, residual_out, acc, residual, weight, eps, pdl, "add_rmsnorm_fixed")
    return out, residual_out


def _like(x: torch.Tensor, t: torch.Tensor | None, name: str) -> torch.Tensor:
    if t is None:
        return torch.empty_like(x)
    check_tensor(t, name, torch.bfloat16, tuple(x.shape), x.device)
    return t


def _launch(out, residual_out, x, residual, weight, eps: float, pdl: bool, name: str = "rmsnorm_bf16",
            parts: int = 1) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_cuda:
        raise ValueError("x must be a CUDA tensor [..., H]")
    h = x.shape[-1]
    if h % 8 or not 8 <= h <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be a multiple of 8 in 8..{MAX_HIDDEN}, got {h}")
    dtype = {"add_rmsnorm_f32": torch.float32, "add_rmsnorm_fixed": torch.int64}.get(name, torch.bfloat16)
    check_tensor(x, "x", dtype, tuple(x.shape), x.device)
    check_tensor(weight, "weight", torch.bfloat16, (h,), x.device)
    rows = x.numel() // (h * parts)
    if rows == 0:
        return
    args = [out, residual_out, x, residual, weight, I32(h), F32(eps)]
    if name == "add_rmsnorm_f32":
        args.append(I32(parts))
    _kernel(name).launch((rows,), (norm_threads(h),), args, pdl=pdl, device=x.device.index)


def norm_threads(h: int) -> int:
    """Threads of a CTA normalizing one row of h values (<= MAX_VEC_PER_THREAD vectors of 8 each)."""
    return min(MAX_THREADS, -(-(h // 8) // 32) * 32)
