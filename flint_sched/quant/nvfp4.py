"""NVFP4 weights: E2M1 codes with one unsigned-E4M3 scale per 16 weights and an FP32 tensor scale.

    weight[..., n, k] = E2M1(code[n, k]) * UE4M3(block_scale[n, k // 16]) * tensor_scale[e]

Two byte layouts hold the same codes and scales, bit for bit:

GGUF (GGML type 40), per row of K weights, K/64 blocks of 36 bytes:
    [s0 s1 s2 s3 | q0 ... q31]     s_i: UE4M3 scale of sub-block i (16 weights)
    sub-block i uses q[8i .. 8i+7]; byte q[8i+j] = w[16i+j] (low nibble) | w[16i+j+8] (high nibble)

Kernel layout (`NVFP4Tensor`, what `repack_from_gguf` returns and the CUDA kernels read):
    codes        uint8 [..., N, K/2]   little-endian 32-bit words, word k/8 = w[k] .. w[k+7]
    block_scales uint8 [..., N, K/16]  raw UE4M3 byte of weights 16j .. 16j+15
    tensor_scale fp32  [E] (E = 1, or the number of stacked experts)
Codes and scales are separate, row-major streams so a thread reads 16 bytes of codes (32 weights)
and 2 scale bytes with vector loads. A code is sign (bit 3) + E2M1 magnitude (bits 0-2): 0, 0.5, 1,
1.5, 2, 3, 4, 6. Within a word the kernels decode the pairs (w[j], w[j+4]) into bf16x2 with the
magnitude at bits 8..6 and the sign at 15 of each half (cuda/nvfp4.cuh); the word's bits are laid
out (`WORD_BITS`) so that pair 0 sits there already (one mask), pairs 1 and 2 sit there rotated by 3
and 6 bits (a funnel shift and a mask) and pair 3 needs one multiply to spread it (mask, multiply,
mask): 8 integer operations a word, against 13 for nibbles in weight order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK_ELEMS = 64          # weights per GGUF type-40 block
BLOCK_BYTES = 36          # 4 scale bytes + 32 code bytes
SUB_BLOCK = 16            # weights per scale
E2M1_MAX = 6.0
UE4M3_MAX = 448.0
UE4M3_NAN = 0x7F          # decodes to 0 (as ggml does); never produced by `quantize`

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ue4m3_values() -> torch.Tensor:
    """fp32 value of each of the 256 scale bytes (bias 7, bit 7 ignored, 0x7F -> 0), as ggml."""
    code = torch.arange(256, dtype=torch.int32)
    exp = (code >> 3) & 0xF
    man = (code & 0x7).float()
    value = torch.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * torch.exp2(exp.float() - 7))
    return torch.where((code == 0) | (code == UE4M3_NAN), torch.zeros(()), value)


def e2m1_values() -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)


@dataclass
class NVFP4Tensor:
    """A quantized weight [..., N, K] in the kernel layout (see module docstring)."""

    codes: torch.Tensor         # uint8 [..., N, K/2]
    block_scales: torch.Tensor  # uint8 [..., N, K/16]
    tensor_scale: torch.Tensor  # fp32 [E]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.block_scales, self.tensor_scale))

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes.to(device), self.block_scales.to(device), self.tensor_scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block values × tensor scale, computed in fp32 (exact up to the final product)."""
        return (self.block_values() * self._broadcast_scale()).to(dtype)

    def block_values(self) -> torch.Tensor:
        """E2M1 × UE4M3 in fp32, without the tensor scale; exact."""
        codes = unpack_nibbles(self.codes).long()
        values = e2m1_values().to(self.device)[codes]
        scales = ue4m3_values().to(self.device)[self.block_scales.long()]
        return values * scales.repeat_interleave(SUB_BLOCK, dim=-1)

    def _broadcast_scale(self) -> torch.Tensor:
        lead = self.codes.shape[:-2]
        if self.tensor_scale.numel() == 1:
            return self.tensor_scale.reshape([1] * (len(lead) + 2))
        return self.tensor_scale.reshape(*lead, 1, 1)


# Bit of a code word holding bit b (0: m, 1: e0, 2: e1, 3: sign) of weight i (0..7) of the word.
# Pair j = (w[j], w[j+4]) decodes as bf16x2 bits {6, 7, 8, 15} + {0, 16}: pair 0 in place, pairs 1 and 2
# that pattern rotated left by 3 and 6 bits (so a right rotation restores it), pair 3 in the bits left
# over, where (word & 0x001B001B) * 0x1084 puts each bit in place without a carry (cuda/nvfp4.cuh).
WORD_BITS = ((6, 7, 8, 15), (9, 10, 11, 18), (12, 13, 14, 21), (4, 0, 1, 3),
             (22, 23, 24, 31), (25, 26, 27, 2), (28, 29, 30, 5), (20, 16, 17, 19))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] (code words, K % 8 == 0) -> uint8 codes [..., K] in weight order."""
    b = packed.unflatten(-1, (-1, 4)).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = []
    for bits in WORD_BITS:
        code = torch.zeros_like(word)
        for b, pos in enumerate(bits):
            code |= ((word >> pos) & 1) << b
        codes.append(code)
    return torch.stack(codes, dim=-1).flatten(-2).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] in weight order (K % 8 == 0) -> uint8 code words [..., K/2]."""
    if codes.shape[-1] % 8:
        raise ValueError(f"NVFP4 code words hold 8 weights; a row of {codes.shape[-1]} does not divide")
    weights = codes.unflatten(-1, (-1, 8))
    word = torch.zeros(weights.shape[:-1], dtype=torch.int32, device=codes.device)
    for i, bits in enumerate(WORD_BITS):
        code = weights[..., i].to(torch.int32)
        for b, pos in enumerate(bits):
            word |= ((code >> b) & 1) << pos
    return torch.stack([(word >> 8 * k) & 0xFF for k in range(4)], dim=-1).flatten(-2).to(torch.uint8)


# -- quantization (the checkpoint writer; runs on whatever device the weight is on) ---------------


def quantize(weight: torch.Tensor, per_leading_scale: bool = False) -> NVFP4Tensor:
    """Quantize [..., N, K] (K % 64 == 0) to NVFP4 with round-to-nearest codes and scales.

    The tensor scale maps the largest |weight| to E2M1_MAX × UE4M3_MAX; with
    `per_leading_scale` each index of the first dimension (an expert) gets its own.
    """
    if weight.dim() < 2 or weight.shape[-1] % BLOCK_ELEMS:
        raise ValueError(f"NVFP4 needs [..., N, K] with K a multiple of {BLOCK_ELEMS}, got {tuple(weight.shape)}")
    w = weight.float()
    if per_leading_scale:
        amax = w.abs().flatten(1).amax(dim=1)
    else:
        amax = w.abs().amax().reshape(1)
    tensor_scale = torch.where(amax > 0, amax / (E2M1_MAX * UE4M3_MAX), torch.ones_like(amax))
    scale_view = tensor_scale.reshape(-1, *([1] * (w.dim() - 1))) if per_leading_scale else tensor_scale
    w = w / scale_view

    blocks = w.unflatten(-1, (-1, SUB_BLOCK))                       # [..., N, K/16, 16]
    wanted = blocks.abs().amax(dim=-1) / E2M1_MAX                   # [..., N, K/16]
    scale_bytes = _nearest_ue4m3(wanted)
    scale = ue4m3_values().to(w.device)[scale_bytes.long()]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    codes = _nearest_e2m1(blocks / safe)
    codes = torch.where(scale.unsqueeze(-1) > 0, codes, torch.zeros_like(codes))
    return NVFP4Tensor(pack_nibbles(codes.flatten(-2)), scale_bytes, tensor_scale.float())


def _nearest_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 to the nearest UE4M3 byte in 0x00 .. 0x7E (saturating)."""
    table = ue4m3_values().to(x.device)[: UE4M3_NAN]                # ascending, codes 0..126
    x = x.clamp(0, UE4M3_MAX).contiguous()
    hi = torch.bucketize(x, table).clamp(max=UE4M3_NAN - 1)
    lo = (hi - 1).clamp(min=0)
    pick_lo = (x - table[lo]) <= (table[hi] - x)
    return torch.where(pick_lo, lo, hi).to(torch.uint8)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest E2M1 code (saturating at ±6); ties go to the smaller magnitude."""
    magnitudes = e2m1_values()[:8].to(x.device)
    midpoints = ((magnitudes[1:] + magnitudes[:-1]) / 2).contiguous()
    mag_code = torch.bucketize(x.abs().contiguous(), midpoints)      # 0..7
    sign = (x < 0).to(torch.uint8) << 3
    return (mag_code.to(torch.uint8) | sign) & torch.where(mag_code == 0, 0x7, 0xF).to(torch.uint8)


# -- GGUF type-40 blocks <-> kernel layout (lossless) ---------------------------------------------


def repack_from_gguf(blocks: torch.Tensor, tensor_scale: torch.Tensor) -> NVFP4Tensor:
    """GGUF bytes uint8 [..., N, K/64*36] -> NVFP4Tensor; a bit-exact permutation."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"GGUF NVFP4 rows must be uint8 with a multiple of {BLOCK_BYTES} bytes, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    b = blocks.unflatten(-1, (-1, BLOCK_BYTES))                     # [..., N, K/64, 36]
    scales = b[..., :4].flatten(-2)                                 # [..., N, K/16]
    q = b[..., 4:].unflatten(-1, (4, 8))                            # [..., N, K/64, 4, 8]
    codes = torch.cat((q & 0xF, q >> 4), dim=-1)                    # [..., 4, 16] in weight order
    packed = pack_nibbles(codes.flatten(-3))
    return NVFP4Tensor(packed.contiguous(), scales.contiguous(), tensor_scale.float().reshape(-1))


def repack_to_gguf(t: NVFP4Tensor) -> torch.Tensor:
    """NVFP4Tensor -> GGUF bytes uint8 [..., N, K/64*36]; inverse of `repack_from_gguf`."""
    codes = unpack_nibbles(t.codes).unflatten(-1, (-1, 4, SUB_BLOCK))   # [..., N, K/64, 4, 16]
    q = codes[..., :8] | (codes[..., 8:] << 4)                      # [..., N, K/64, 4, 8]
    scales = t.block_scales.unflatten(-1, (-1, 4))                  # [..., N, K/64, 4]
    out = torch.cat((scales, q.flatten(-2)), dim=-1)                # [..., N, K/64, 36]
    return out.flatten(-2).contiguous()


def gguf_row_bytes(num_elems: int) -> int:
    return num_elems // BLOCK_ELEMS * BLOCK_BYTES


def as_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().cpu().numpy()
