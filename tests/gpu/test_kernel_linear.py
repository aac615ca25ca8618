"""Skinny GEMM kernels (cuda/gemv.cu) against fp32 torch on the same bf16 inputs / dequantized weights.

Outputs are NaN-poisoned before each launch, so unwritten elements fail. The one-hot tests pick
single weights out (y[b, n] = W[n, k_b]) and must match bit for bit: they pin the fragment
layout and the NVFP4 decode (every nibble position, every scale byte) exactly.
"""

import pytest
import torch
import torch.nn.functional as F

from flint_sched.kernels import gate_up_silu, linear
from flint_sched.kernels.linear import concat_rows
from gpu_checks import assert_close_bf16, gen, poisoned
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize

pytestmark = pytest.mark.gpu

BF16_SHAPES = [(5120, 2048), (2048, 4096), (37, 200), (1000, 136), (130, 4104), (16, 8)]
NVFP4_SHAPES = [(5120, 2048), (2048, 4096), (37, 192), (1000, 2112), (130, 64)]




def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, device="cuda", generator=gen(seed)) / k**0.5).bfloat16()


def nvfp4_weight(n: int, k: int, seed: int) -> NVFP4Tensor:
    return quantize(torch.randn(n, k, device="cuda", generator=gen(seed)) / k**0.5)


def raw_nvfp4_weight(n: int, k: int, seed: int, tensor_scale: float = 0.75) -> NVFP4Tensor:
    """Arbitrary bytes: every code, every scale byte (bit 7 set, 0x7F, subnormals)."""
    g = gen(seed)
    codes = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (n, k // 16), device="cuda", dtype=torch.uint8, generator=g)
    return NVFP4Tensor(codes, scales, torch.tensor([tensor_scale], device="cuda"))


def dense(w) -> torch.Tensor:
    return w.dequantize(torch.float32) if isinstance(w, NVFP4Tensor) else w.float()


def activations(b: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(b, k, device="cuda", generator=gen(seed)).bfloat16()



@pytest.mark.parametrize("n,k", BF16_SHAPES)
@pytest.mark.parametrize("b", [1, 3, 8, 9, 13, 16, 17, 24, 29, 32])
def test_linear_bf16(b, n, k):
    w, x = bf16_weight(n, k, seed=n + k), activations(b, k, seed=b)
    y = linear(x, w, out=poisoned(b, n))
    assert_close_bf16(y, x.float() @ w.float().t(), f"bf16 linear B={b} N={n} K={k}")


@pytest.mark.parametrize("n,k", [(256, 2048), (37, 200), (16, 8)])
@pytest.mark.parametrize("b", [1, 9, 16, 32])
def test_linear_fp32_out(b, n, k):
    """The router's logits: fp32 sums written unrounded (within fp32 summation-order error)."""
    w, x = bf16_weight(n, k, seed=n + k), activations(b, k, seed=b)
    out = torch.full((b, n), float("nan"), device="cuda")
    y = linear(x, w, out=out, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", NVFP4_SHAPES)
@pytest.mark.parametrize("b", [1, 3, 8, 9, 13, 16, 17, 24, 29, 32])
def test_linear_nvfp4(b, n, k):
    w, x = nvfp4_weight(n, k, seed=n + k), activations(b, k, seed=b)
    y = linear(x, w, out=poisoned(b, n))
    assert_close_bf16(y, x.float() @ dense(w).t(), f"nvfp4 linear B={b} N={n} K={k}")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("b", [1, 5, 8, 16, 27])
def test_concatenated_rows_keep_each_parts_tensor_scale(fmt, b):
    """q/k/v as one GEMV: three parts with very different NVFP4 tensor scales, split at a tile
    boundary (4096) and inside a tile (4104); each output row equals its own part's product."""
    k = 2048
    if fmt == "nvfp4":
        parts = [raw_nvfp4_weight(n, k, seed=n, tensor_scale=s) for n, s in ((4096, 0.25), (8, 3.0), (520, 1e-3))]
    else:
        parts = [bf16_weight(n, k, seed=n) for n in (4096, 8, 520)]
    fused, splits = concat_rows(parts)
    assert splits == (4096, 4104) and tuple(fused.shape) == (4624, k)
    x = activations(b, k, seed=b)
    y = linear(x, fused, out=poisoned(b, 4624), row_splits=splits)
    expected = torch.cat([x.float() @ dense(w).t() for w in parts], dim=1)
    for (start, end), w in zip(((0, 4096), (4096, 4104), (4104, 4624)), parts):
        assert_close_bf16(y[:, start:end], expected[:, start:end], f"{fmt} rows {start}:{end} B={b}")


def test_row_splits_are_checked():
    x, w = activations(1, 64, seed=0), bf16_weight(32, 64, seed=0)
    for bad in ((0,), (40,), (16, 8), (4, 8, 12)):
        with pytest.raises(ValueError, match="row_splits"):
            linear(x, w, row_splits=bad)


@pytest.mark.parametrize("b", [1, 8, 11])
def test_linear_nvfp4_arbitrary_bytes(b):
    w, x = raw_nvfp4_weight(300, 1024, seed=7), activations(b, 1024, seed=3)
    y = linear(x, w, out=poisoned(b, 300))
    assert_close_bf16(y, x.float() @ dense(w).t(), f"nvfp4 linear, random bytes, B={b}")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_one_hot_inputs_read_single_weights_exactly(fmt):
    """x rows are one-hot at k_b, so y[b, n] = W[n, k_b]: exact in bf16 for both formats."""
    n, k = 40, 256
    w = raw_nvfp4_weight(n, k, seed=11, tensor_scale=1.0) if fmt == "nvfp4" else bf16_weight(n, k, seed=11)
    wf = dense(w)
    bad = []
    for start in range(0, k, 8):
        cols = torch.arange(start, start + 8, device="cuda")
        x = torch.zeros(8, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(8), cols] = 1
        y = linear(x, w, out=poisoned(8, n))
        expected = wf[:, cols].t().bfloat16()
        if not torch.equal(y, expected):
            diff = (y.float() != expected.float()).nonzero()
            bad.append((start, diff[:4].tolist()))
    assert not bad, (f"{fmt}: weights read wrongly at k-blocks (start, [[token, row], ...]): {bad[:6]}; "
                     "k mod 8 / mod 32 of the failures points at the fragment or nibble mapping")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("n,k", [(2048, 4096), (37, 192)])
@pytest.mark.parametrize("b", [3, 12, 30])
def test_linear_with_residual_in_place(fmt, n, k, b):
    w = nvfp4_weight(n, k, seed=5) if fmt == "nvfp4" else bf16_weight(n, k, seed=5)
    x, residual = activations(b, k, seed=1), activations(b, n, seed=2)
    ref = x.float() @ dense(w).t() + residual.float()
    y = linear(x, w, residual=residual, out=residual)
    assert y.data_ptr() == residual.data_ptr()
    assert_close_bf16(y, ref, f"{fmt} linear + residual in place")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("i,k", [(10240, 2048), (512, 2048), (37, 192)])
@pytest.mark.parametrize("b", [1, 3, 8, 9, 13, 16, 21, 32])
def test_gate_up_silu(fmt, b, i, k):
    make = nvfp4_weight if fmt == "nvfp4" else bf16_weight
    gate, up = make(i, k, seed=21), make(i, k, seed=22)
    x = activations(b, k, seed=b + 10)
    h = gate_up_silu(x, gate, up, out=poisoned(b, i))
    xf = x.float()
    ref = F.silu(xf @ dense(gate).t()) * (xf @ dense(up).t())
    assert_close_bf16(h, ref, f"{fmt} gate_up_silu B={b} I={i} K={k}")


def test_lm_head_shape():
    n, k = 151552, 2048
    w, x = bf16_weight(n, k, seed=3), activations(2, k, seed=4)
    y = linear(x, w, out=poisoned(2, n))
    assert_close_bf16(y, x.float() @ w.float().t(), "LM head")


def test_cuda_graph_replay_and_pdl_chain():
    """Launches are captured by a CUDA graph; PDL-chained launches see their predecessor's output."""
    k, n = 2048, 2048
    w1, w2 = bf16_weight(n, k, seed=31), nvfp4_weight(n, n, seed=32)
    x = activations(4, k, seed=5)
    y1, y2 = poisoned(4, n), poisoned(4, n)
    linear(x, w1, out=y1, pdl=True)          # load the kernels before capture
    linear(y1, w2, out=y2, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, w1, out=y1, pdl=True)
        linear(y1, w2, out=y2, pdl=True)
    for seed in (6, 7):
        x.copy_(activations(4, k, seed=seed))
        y1.fill_(float("nan"))
        y2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref1 = x.float() @ w1.float().t()
        assert_close_bf16(y1, ref1, f"graph replay, first linear (seed {seed})")
        assert_close_bf16(y2, y1.float() @ dense(w2).t(), f"graph replay, PDL-dependent linear (seed {seed})")


def test_rejects_bad_inputs():
    w = bf16_weight(64, 64, seed=0)
    x = activations(2, 64, seed=0)
    with pytest.raises(ValueError):
        linear(x, w, residual=torch.zeros(2, 64, device="cuda").bfloat16(), out_dtype=torch.float32)
    with pytest.raises(ValueError):
        linear(x, nvfp4_weight(64, 64, seed=0), out_dtype=torch.float32)    # fp32 out: bf16 weights only
    with pytest.raises(ValueError):
        linear(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError):
        linear(x, w, out=torch.empty(2, 64, device="cuda").bfloat16(), out_dtype=torch.float32)
    with pytest.raises(ValueError):
        linear(activations(33, 64, seed=0), w)                     # more than 32 tokens
    with pytest.raises(ValueError):
        linear(activations(2, 64, seed=0).float(), w)
    with pytest.raises(ValueError):
        linear(activations(2, 64, seed=0), nvfp4_weight(64, 64, seed=0).codes)  # uint8 is no weight
    with pytest.raises(ValueError):
        linear(activations(2, 96, seed=0), nvfp4_weight(64, 96 + 32, seed=0))


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("b", [1, 5, 8, 16])
def test_a_folded_norm_matches_the_norm_then_the_gemv(fmt, b):
    """linear(x, W, norm_weight=w) against rms_norm(x, w) @ W^T in fp64 (the same weights), as close as
    the norm's own launch then the GEMV are, with q/k/v's row splits (NVFP4) and a residual. The two
    round differently (x * w to bf16, against x * inv_rms * w), so each is held to the fp64 truth, not
    to the other: on the H200 (session 31) both sit at 2.2-2.4e-3 relative RMS error, and compared to
    each other they differ by up to 3e-2 of a typical output."""
    n, k, eps = 5120, 2048, 1e-6
    if fmt == "nvfp4":                                  # q/k/v: three weights, each its tensor scale
        parts = [nvfp4_weight(rows, k, 11 + i) for i, rows in enumerate((4096, 512, 512))]
        w, splits = concat_rows(parts)
        w64 = torch.cat([t.dequantize(torch.float32) for t in parts]).double()
    else:
        w, splits = bf16_weight(n, k, 11), ()
        w64 = w.double()
    x = (3 * torch.randn(b, k, device="cuda", generator=gen(12))).bfloat16()
    nw = (1 + 0.3 * torch.randn(k, device="cuda", generator=gen(13))).bfloat16()
    residual = torch.randn(b, n, device="cuda", generator=gen(14)).bfloat16()
    x64 = x.double()
    normed64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    for res in (None, residual):
        truth = normed64 @ w64.t() + (0 if res is None else res.double())
        want = linear(rms_norm_ref(x, nw, eps), w, residual=res, row_splits=splits).double()
        got = linear(x, w, residual=res, row_splits=splits, norm_weight=nw, norm_eps=eps, out=poisoned(b, n))
        assert not got.isnan().any(), "an output was not written"
        scale = (truth - (0 if res is None else res.double())).pow(2).mean().sqrt()
        err_got = float((got.double() - truth).pow(2).mean().sqrt() / scale)
        err_want = float((want - truth).pow(2).mean().sqrt() / scale)
        worst = float((got.double() - truth).abs().max() / scale)
        what = f"{fmt} b={b} residual={res is not None}: folded {err_got:.2e}, two launches {err_want:.2e}"
        assert err_got < 1.25 * err_want + 1e-4 and err_got < 5e-3, what
        assert worst < 2 * float((want - truth).abs().max() / scale) + 1e-2, f"{what}, worst {worst:.2e}"
