"""Seeded random weights with the shapes of a real checkpoint, made on any device.

Each tensor has its own generator, seeded from (seed, canonical name), so tensors can be made one at
a time in any order. The same seed gives the same fp32 values on the same kind of device (CPU and
CUDA generators differ). Scales keep activations finite and non-degenerate through all layers:
projections have std 1/sqrt(fan_in), residual outputs are further scaled by 1/sqrt(2 × layers).
"""

from __future__ import annotations

import math
import zlib

import torch

from flint_sched.config import FlintConfig
from flint_sched.model.weights import TensorSpec


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_tensor(spec: TensorSpec, config: FlintConfig, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 values of one tensor."""
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, spec.name))
    x = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    if spec.role == "embedding":
        return x
    if spec.role == "norm":
        return x.mul_(0.1).add_(1.0)
    if spec.role == "sink":
        return x.add_(1.0)
    if spec.role == "router_bias":
        return x.mul_(0.1)
    std = 1.0 / math.sqrt(spec.fan_in)
    if spec.role == "residual_out":
        std /= math.sqrt(2 * config.num_hidden_layers)
    return x.mul_(std)
