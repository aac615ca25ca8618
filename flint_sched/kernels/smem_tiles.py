"""Host side of cuda/smem_tiles.cuh, shared by the one-launch blocks (kernels/moe.py `moe_fused`,
kernels/attention_front.py `qkv_fused`): the size of a shared-memory slot of 16 NVFP4 weight rows, and
the grid-wide counter pair those launches wait on."""

from __future__ import annotations

import torch


def slot_bytes(k: int) -> int:
    """cuda/smem_tiles.cuh slot_shape: 16 rows of k NVFP4 weights (k % 256 == 0), codes and block
    scales, each row padded against bank conflicts."""
    code_pitch = k // 2 + (64 if (k // 2) % 128 == 0 else 0)
    return 16 * (code_pitch + k // 16 + 16)


def grid_counters(device: torch.device | str) -> torch.Tensor:
    """A one-launch block's counter pair (int32, zero; every launch leaves it zero). One per kind of
    block that may run beside another, since each launch's CTAs count on it."""
    return torch.zeros(2, dtype=torch.int32, device=device)
