"""RMSNorm kernels (cuda/rmsnorm.cu) against `rms_norm` of model/reference.py, in fp32."""

import pytest
import torch

from flint_sched.kernels import fused_add_rms_norm, rms_norm
from flint_sched.kernels.norm import add_rms_norm_f32, add_rms_norm_fixed
from flint_sched.model.reference import rms_norm as reference_rms_norm
from gpu_checks import assert_close_bf16

pytestmark = pytest.mark.gpu

EPS = 1e-5

def inputs(tokens: int, hidden: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).mul_(3).bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    return x, residual, weight


@pytest.mark.parametrize("hidden", [8, 64, 520, 2048, 8192])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_fused_add_rms_norm(tokens, hidden):
    x, residual, weight = inputs(tokens, hidden)
    out = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan"))
    fused_add_rms_norm(x, residual, weight, EPS, out=out, residual_out=residual_out)
    s = (x.float() + residual.float()).bfloat16()
    assert torch.equal(residual_out, s), "residual_out must be the bf16 sum, bit for bit"
    assert_close_bf16(out, reference_rms_norm(s.float(), weight.float(), EPS), "fused_add_rms_norm")


@pytest.mark.parametrize("hidden", [64, 2048])
@pytest.mark.parametrize("tokens", [1, 8])
def test_rms_norm(tokens, hidden):
    x, _, weight = inputs(tokens, hidden, seed=1)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, weight, EPS, out=out)
    assert_close_bf16(out, reference_rms_norm(x.float(), weight.float(), EPS), "rms_norm")


def test_in_place():
    x, residual, weight = inputs(3, 2048, seed=2)
    s = (x.float() + residual.float()).bfloat16()
    ref = reference_rms_norm(s.float(), weight.float(), EPS)
    fused_add_rms_norm(x, residual, weight, EPS, out=x, residual_out=residual)
    assert torch.equal(residual, s)
    assert_close_bf16(x, ref, "in-place fused_add_rms_norm")


def test_many_rows_and_leading_dims():
    x, residual, weight = inputs(4 * 37, 256, seed=3)
    x, residual = x.view(4, 37, 256), residual.view(4, 37, 256)
    out, residual_out = fused_add_rms_norm(x, residual, weight, EPS)
    s = (x.float() + residual.float()).bfloat16()
    assert torch.equal(residual_out, s)
    assert_close_bf16(out, reference_rms_norm(s.float(), weight.float(), EPS), "[4, 37, 256] rows")


def test_rejects_bad_shapes():
    x, residual, weight = inputs(2, 64)
    with pytest.raises(ValueError):
        rms_norm(x[:, :60].contiguous(), weight[:60], EPS)   # H % 8 != 0
    with pytest.raises(ValueError):
        rms_norm(x.float(), weight, EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, residual[:1], weight, EPS)


@pytest.mark.parametrize("hidden", [8, 520, 2048, 8192])
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_add_rms_norm_f32_is_torch_add_then_rms_norm(tokens, hidden):
    """The residual epilogue after cuBLAS with the norm that follows it: the sum bit for bit
    torch.add(fp32, bf16, out=bf16), the norm bit for bit the rmsnorm kernel's on that sum;
    in place on the residual too."""
    _, residual, weight = inputs(tokens, hidden, seed=4)
    x = torch.randn(tokens, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    s = torch.add(x, residual, out=torch.empty_like(residual))
    expected = rms_norm(s, weight, EPS)
    out, residual_out = torch.full_like(residual, float("nan")), torch.full_like(residual, float("nan"))
    add_rms_norm_f32(x, residual, weight, EPS, out=out, residual_out=residual_out)
    assert torch.equal(residual_out, s) and torch.equal(out, expected)
    add_rms_norm_f32(x, residual, weight, EPS, out=out, residual_out=residual)
    assert torch.equal(residual, s) and torch.equal(out, expected)
    with pytest.raises(ValueError, match="float32"):
        add_rms_norm_f32(x.bfloat16(), residual, weight, EPS, out=out, residual_out=residual_out)


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 17, 128])
def test_add_rms_norm_f32_adds_split_k_parts_in_order(tokens, parts):
    """x as split-K parts [S, rows, H]: the sum as torch adds the parts in order, then as one x."""
    _, residual, weight = inputs(tokens, 2048, seed=6)
    x = torch.randn(parts, tokens, 2048, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    total = x[0].clone()
    for q in range(1, parts):
        total += x[q]
    expected_out, expected_s = add_rms_norm_f32(total, residual, weight, EPS)
    out, residual_out = add_rms_norm_f32(x, residual, weight, EPS)
    assert torch.equal(residual_out, expected_s) and torch.equal(out, expected_out)
    with pytest.raises(ValueError, match="parts"):
        add_rms_norm_f32(torch.zeros(9, tokens, 2048, device="cuda"), residual, weight, EPS)


@pytest.mark.parametrize("tokens", [1, 5])
def test_add_rms_norm_fixed_reads_the_fixed_point_sum_and_zeroes_it(tokens):
    """acc int64 of value x 2^32 (kernels/moe.py moe_split's sum): as add_rms_norm_f32 of the value
    (int64 -> fp32 rounded to nearest, times 2^-32), bit for bit; acc all zeros after."""
    _, residual, weight = inputs(tokens, 2048, seed=8)
    g = torch.Generator(device="cuda").manual_seed(9)
    value = 50 * torch.randn(tokens, 2048, device="cuda", generator=g, dtype=torch.float64)
    acc = torch.round(value * 2.0**32).to(torch.int64)
    expected_out, expected_s = add_rms_norm_f32(acc.float() * 2.0**-32, residual, weight, EPS)
    out, residual_out = add_rms_norm_fixed(acc, residual, weight, EPS)
    assert torch.equal(residual_out, expected_s) and torch.equal(out, expected_out)
    assert torch.count_nonzero(acc) == 0
    with pytest.raises(ValueError, match="torch.int64"):
        add_rms_norm_fixed(acc.float(), residual, weight, EPS)
