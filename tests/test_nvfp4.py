"""NVFP4: the GGUF type-40 codec, the lossless repack, and the quantization error bound."""

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf.quants import dequantize as gguf_dequantize

from flint_sched.quant.nvfp4 import (NVFP4Tensor, e2m1_values, pack_nibbles, quantize, repack_from_gguf,
                                     repack_to_gguf, ue4m3_values, unpack_nibbles)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_gguf_bytes_repack_and_back_is_bit_exact(rows, blocks, seed):
    """Any bytes at all (bit 7 of a scale set, 0x7F, every nibble) survive the round trip."""
    raw = torch.randint(0, 256, (rows, blocks * 36), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    packed = repack_from_gguf(raw, torch.tensor([0.75]))
    assert packed.shape == (rows, blocks * 64)
    assert torch.equal(repack_to_gguf(packed), raw)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_dequantized_values_equal_the_gguf_package_exactly(rows, blocks, seed):
    raw = torch.randint(0, 256, (rows, blocks * 36), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    ours = repack_from_gguf(raw, torch.tensor([1.0])).block_values().numpy()
    theirs = gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType.NVFP4).reshape(ours.shape)
    assert np.array_equal(ours, theirs)
    scale = np.float32(0.0123)
    with_scale = repack_from_gguf(raw, torch.tensor([scale])).dequantize().numpy()
    assert np.array_equal(with_scale, theirs * scale)


def test_stacked_experts_have_one_scale_each():
    w = torch.randn(3, 8, 128)
    w[1] *= 100
    q = quantize(w, per_leading_scale=True)
    assert q.tensor_scale.shape == (3,) and q.tensor_scale[1] > 50 * q.tensor_scale[0]
    back = repack_from_gguf(repack_to_gguf(q), q.tensor_scale)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert torch.equal(q.dequantize()[1], NVFP4Tensor(q.codes[1], q.block_scales[1], q.tensor_scale[1:2]).dequantize())


def test_scale_table_matches_the_format():
    values = ue4m3_values()
    assert values[0x7E] == 448.0 and values[0x7F] == 0.0 and values[0x38] == 1.0
    assert values[0x01] == 2.0 ** -9                          # smallest subnormal
    assert torch.all(values[1:0x7F].diff() > 0)               # monotonic: nearest rounding is a search
    assert e2m1_values()[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_quantized_codes_are_exact_for_representable_values():
    # values on the E2M1 grid whose sub-blocks all reach ±6: codes exact, block scales all 448,
    # so only the tensor scale's own fp32 rounding remains
    grid = e2m1_values()[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))] * 0.25
    grid[:, ::16] = 6 * 0.25
    q = quantize(grid)
    assert torch.all(q.block_scales == 0x7E)
    torch.testing.assert_close(q.dequantize(), grid, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_quantization_error_on_normal_data_is_within_the_e2m1_e4m3_bound(scale):
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)) * scale
    q = quantize(w)
    err = q.dequantize() - w
    # RMS error of 4-bit E2M1 with 16-element blocks on Gaussian data is ~9–10 % of the RMS value
    assert err.norm() / w.norm() < 0.11
    # per element: at most half the widest E2M1 gap (1.0 × block scale), plus the scale's own rounding
    blocks = w.view(64, -1, 16)
    step = q.block_values().view(64, -1, 16).abs().amax(-1, keepdim=True) / 6 * q.tensor_scale
    amax = blocks.abs().amax(-1, keepdim=True)
    bound = step * 1.0 + (amax - 6 * step).clamp(min=0) + 1e-12
    assert torch.all(err.view(64, -1, 16).abs() <= bound * (1 + 1e-5))


def test_zero_blocks_and_bad_shapes():
    w = torch.zeros(2, 64)
    w[1, :16] = 1.0
    q = quantize(w)
    assert torch.equal(q.dequantize()[0], torch.zeros(64)) and q.dequantize()[1, :16].eq(1.0).all()
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of 36"):
        repack_from_gguf(torch.zeros(2, 35, dtype=torch.uint8), torch.ones(1))


def decode_word_like_the_kernels(words: np.ndarray) -> np.ndarray:
    """cuda/nvfp4.cuh e2m1x8_to_bf16 without the scale: uint32 words [W] -> uint32 pairs [W, 4]."""
    pair, q = np.uint32(0x81C081C0), words.astype(np.uint32)

    def rotr(x, s):
        return (x >> np.uint32(s)) | (x << np.uint32(32 - s))
    spread = ((q & np.uint32(0x001B001B)).astype(np.uint64) * 0x1084 & 0xFFFFFFFF).astype(np.uint32)
    return np.stack([q & pair, rotr(q, 3) & pair, rotr(q, 6) & pair, spread & pair], axis=-1)


def test_code_words_decode_to_the_bf16_pairs_the_kernels_expect():
    """Random codes at every place of a word: the kernels' bit recipe gives pair j = (w[j], w[j+4]) with
    each code's magnitude at bf16 bits 8..6 and its sign at 15; packing is lossless."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 4096), dtype=torch.uint8, generator=g)
    packed = pack_nibbles(codes)
    assert packed.shape == (64, 2048) and torch.equal(unpack_nibbles(packed), codes)
    words = packed.numpy().view("<u4").reshape(-1)
    c = codes.numpy().astype(np.uint32).reshape(-1, 8)
    bits = ((c & 7) << 6) | ((c & 8) << 12)                        # a code's bf16 bits (x 2^-126)
    expected = bits[:, :4] | (bits[:, 4:] << 16)
    assert np.array_equal(decode_word_like_the_kernels(words), expected)
    every = torch.arange(16, dtype=torch.uint8)
    # the spread pair: all 256 (w3, w7) combinations, the other bits random (no carry reaches a pair bit)
    both = torch.cartesian_prod(every, every)
    some = torch.randint(0, 16, (256, 8), dtype=torch.uint8, generator=g)
    some[:, 3], some[:, 7] = both[:, 0], both[:, 1]
    w = pack_nibbles(some.flatten()).numpy().view("<u4")
    b = ((some.numpy().astype(np.uint32) & 7) << 6) | ((some.numpy().astype(np.uint32) & 8) << 12)
    assert np.array_equal(decode_word_like_the_kernels(w)[:, 3], b[:, 3] | (b[:, 7] << 16))
