"""NVFP4 -> bf16 weights on the GPU (cuda/nvfp4_dequant.cu): the grouped path's large-M GEMMs
dequantize a weight once per call and hand it to cuBLAS, which then runs near the tensor cores'
rate; at 32+ rows that beats decoding the weight in every row-chunk's registers.

Values equal `NVFP4Tensor.dequantize(torch.bfloat16)` bit for bit (same products, one rounding).
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels._runtime import I32, Kernel, compile_kernel
from flint_sched.kernels.linear import check_row_splits, check_tensor
from flint_sched.quant.nvfp4 import NVFP4Tensor

THREADS = 256


@functools.cache
def _kernel() -> Kernel:
    return compile_kernel("nvfp4_dequant.cu", "nvfp4_to_bf16")


def dequantize_bf16(w: NVFP4Tensor, out: torch.Tensor | None = None, row_splits: tuple[int, ...] = (),
                    pdl: bool = False) -> torch.Tensor:
    """bf16 [N, K] of a 2-D NVFP4 weight (K % 32 == 0); `row_splits` as `concat_rows` gives them."""
    if not isinstance(w, NVFP4Tensor) or w.codes.dim() != 2:
        raise ValueError("w must be a 2-D NVFP4Tensor")
    n, k = w.shape
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    check_row_splits(row_splits, n)
    dev = w.codes.device
    check_tensor(w.codes, "codes", torch.uint8, (n, k // 2), dev)
    check_tensor(w.block_scales, "block_scales", torch.uint8, (n, k // 16), dev, 2)
    check_tensor(w.tensor_scale, "tensor_scale", torch.float32, (len(row_splits) + 1,), dev, 4)
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
    check_tensor(out, "out", torch.bfloat16, (n, k), dev)
    splits = (*row_splits, n, n)[:2]
    chunks = n * (k // 32)
    _kernel().launch((-(-chunks // THREADS),), (THREADS,),
                     [out, w.codes, w.block_scales, w.tensor_scale, I32(n), I32(k), I32(splits[0]), I32(splits[1])],
                     pdl=pdl, device=dev.index)
    return out
