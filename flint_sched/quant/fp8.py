"""The FP8 KV cache's element type (`--kv-cache-dtype fp8`): e4m3 with scale 1, as vLLM's default
without calibrated scales. Writes saturate at +-448 (torch's cast would make NaN of larger values);
every e4m3 value is exact in bf16, f16 and fp32, so reads are plain casts."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
KV_CACHE_DTYPES = {"auto": None, "fp8": E4M3, "fp8_e4m3": E4M3}   # --kv-cache-dtype -> the cache's dtype


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a --kv-cache-dtype name: e4m3, or the compute dtype ("auto")."""
    return KV_CACHE_DTYPES[name] or compute_dtype


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: e4m3 of its bf16 rounding (as the kernels write), saturated; other
    dtypes a plain cast."""
    if dtype != E4M3:
        return x.to(dtype)
    return x.to(torch.bfloat16).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def round_kv(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x as attention reads it back from a cache of `dtype` (None, or x's own dtype: unchanged)."""
    if dtype is None or dtype == x.dtype:
        return x
    return to_kv(x, dtype).to(x.dtype)
