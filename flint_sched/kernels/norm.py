"""RMSNorm launchers (cuda/rmsnorm.cu): plain, and fused with the residual add.

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


@functools.cache
def _kernel() -> Kernel:
    return compile_kernel("rmsnorm.cu", "rmsnorm_bf16")


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


def _like(x: torch.Tensor, t: torch.Tensor | None, name: str) -> torch.Tensor:
    if t is None:
        return torch.empty_like(x)
    check_tensor(t, name, torch.bfloat16, tuple(x.shape), x.device)
    return t


def _launch(out, residual_out, x, residual, weight, eps: float, pdl: bool) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_cuda:
        raise ValueError("x must be a CUDA tensor [..., H]")
    h = x.shape[-1]
    if h % 8 or not 8 <= h <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be a multiple of 8 in 8..{MAX_HIDDEN}, got {h}")
    check_tensor(x, "x", torch.bfloat16, tuple(x.shape), x.device)
    check_tensor(weight, "weight", torch.bfloat16, (h,), x.device)
    rows = x.numel() // h
    if rows == 0:
        return
    num_vec = h // 8
    threads = min(MAX_THREADS, -(-num_vec // 32) * 32)  # <= MAX_VEC_PER_THREAD vectors each
    _kernel().launch((rows,), (threads,), [out, residual_out, x, residual, weight, I32(h), F32(eps)],
                     pdl=pdl, device=x.device.index)
