"""bf16 copies of an NVFP4 checkpoint's dense weights, made once at start-up.

Steps of COPY_MIN_ROWS rows or more (grouped decode batches, prompt steps) run the dense layers
(fused q/k/v, o_proj, the dense MLP of the first layers; the LM head is bf16 in the checkpoint) on
cuBLAS over bf16 weights. Without these copies every such step dequantized ~1.05 B
weights again (2.1 GB written, then read back, at Flint's size); with them a step only reads the
bf16 weights. The copies equal what that per-step dequantization produced bit for bit
(kernels/dequant.py), so results do not change; they cost `copies_bytes` of device memory, which
the engine takes from the KV budget. Expert stacks and shared experts stay NVFP4 (the MoE kernels
decode them in registers).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flint_sched.quant.nvfp4 import NVFP4Tensor

# GEMMs from this many rows read the copies (on cuBLAS); below, our kernels decode the NVFP4
# weights. Since session 13 the GEMVs take steps of up to kernel_ops.GEMV_MAX_ROWS (16) rows first,
# so the copies serve steps of 17 rows and more. 9: every grouped decode batch. Measured on the H200
# (benchmarks/RESULTS.md, session 10), full model at 1K, from 17 rows (our grouped NVFP4 GEMMs at
# 9-16 rows) against from 9: batch 9 5.75 -> 4.90 ms, batch 16 6.38 -> 5.28 (cuBLAS reads 4x the
# bytes of q/k/v and o_proj, ~2 GB a step, but our 16-row GEMMs took ~9 µs a launch for ~1.4 µs of
# bytes, and the residual epilogue now carries the RMSNorm after it).
COPY_MIN_ROWS = 9


QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def dense_nvfp4(name: str, w: object) -> bool:
    """A 2-D NVFP4 weight that is not an expert's (routed or shared)."""
    return isinstance(w, NVFP4Tensor) and w.codes.dim() == 2 and "experts." not in name


def copies_bytes(weights: Mapping[str, object]) -> int:
    """Device memory the copies of these weights take (0 for a bf16 checkpoint)."""
    return sum(2 * w.shape[0] * w.shape[1] for name, w in weights.items() if dense_nvfp4(name, w))


class DenseCopies:
    """The bf16 copy of a dense NVFP4 weight, by weight name or by layer (fused q/k/v)."""

    def __init__(self, weights: Mapping[str, object], qkv: Mapping[int, tuple]):
        from flint_sched.kernels.dequant import dequantize_bf16

        self.by_name = {name: dequantize_bf16(w) for name, w in weights.items()
                        if dense_nvfp4(name, w) and not name.endswith(QKV)}   # q/k/v: fused, below
        self.qkv = {i: dequantize_bf16(w, row_splits=splits) for i, (w, splits) in qkv.items()
                    if isinstance(w, NVFP4Tensor)}

    def weight(self, name: str, rows: int, weight):
        """What a GEMM of `rows` rows should read for `name`: the copy where cuBLAS serves it."""
        return self.by_name.get(name, weight) if rows >= COPY_MIN_ROWS else weight

    def qkv_weight(self, layer: int, rows: int, weight, splits: tuple[int, ...]):
        """(weight, row splits) of layer's fused q/k/v for `rows` rows (a bf16 copy has no splits)."""
        copy = self.qkv.get(layer) if rows >= COPY_MIN_ROWS else None
        return (weight, splits) if copy is None else (copy, ())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.by_name.values(), *self.qkv.values()))


def make_copies(weights: Mapping[str, object], qkv: Mapping[int, tuple], device: torch.device) -> DenseCopies | None:
    """The copies on a CUDA device with NVFP4 dense weights, else None (nothing to copy)."""
    if device.type != "cuda" or not any(isinstance(w, NVFP4Tensor) for w, _ in qkv.values()):
        return None
    return DenseCopies(weights, qkv)
