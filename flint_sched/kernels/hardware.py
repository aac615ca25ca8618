"""Hardware figures the launchers size their grids by, read from the device once.

Without a GPU (CI compiles kernels and plans grids on CPU machines) the H200's figures stand in.
"""

from __future__ import annotations

import functools

import torch

FALLBACK_SMS = 132                    # NVIDIA H200 (SXM): used only where no GPU is visible


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device | int | None) -> int | None:
    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device | int | None = None) -> int:
    """Streaming multiprocessors of `device` (default: the current GPU)."""
    index = _index(device)
    return FALLBACK_SMS if index is None else _properties(index).multi_processor_count

