"""concat_rows (kernels/linear.py): the one-GEMV q/k/v weight, built on the CPU."""

import pytest
import torch

from flint_sched.kernels.linear import concat_rows
from flint_sched.quant.nvfp4 import quantize


def test_nvfp4_parts_keep_their_tensor_scales():
    gen = torch.Generator().manual_seed(0)
    parts = [quantize(torch.randn(n, 64, generator=gen) * s) for n, s in ((32, 1.0), (8, 100.0), (24, 1e-3))]
    fused, splits = concat_rows(parts)
    assert splits == (32, 40) and tuple(fused.shape) == (64, 64)
    assert fused.tensor_scale.tolist() == [float(p.tensor_scale) for p in parts]
    values = fused.block_values()
    for part, start, end, scale in zip(parts, (0, 32, 40), (32, 40, 64), fused.tensor_scale.tolist(), strict=True):
        assert torch.equal(values[start:end] * scale, part.dequantize())


def test_bf16_is_a_plain_concatenation():
    parts = [torch.randn(n, 16).bfloat16() for n in (4, 2)]
    fused, splits = concat_rows(parts)
    assert splits == (4,) and torch.equal(fused, torch.cat(parts))


def test_bad_parts_are_refused():
    with pytest.raises(ValueError, match="one K"):
        concat_rows([torch.zeros(4, 16), torch.zeros(4, 32)])
    with pytest.raises(ValueError, match="1..3"):
        concat_rows([torch.zeros(4, 16)] * 4)
    with pytest.raises(ValueError, match="mixing"):
        concat_rows([torch.zeros(4, 64).bfloat16(), quantize(torch.randn(4, 64))])
