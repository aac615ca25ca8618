"""What a loaded checkpoint is, the error every loader raises, and the shared progress bar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from flint_sched.config import FlintConfig
from flint_sched.model.weights import TensorSpec
from flint_sched.quant.nvfp4 import NVFP4Tensor

Weights = dict[str, torch.Tensor | NVFP4Tensor]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and, where known, the tensor."""


@dataclass
class Checkpoint:
    config: FlintConfig
    tokenizer: Any          # flint_sched.tokenizer.FlintTokenizer
    weights: Weights
    weight_format: str      # "nvfp4" or "bf16"
    source: str             # file, directory or "dummy"

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes if isinstance(w, NVFP4Tensor) else w.numel() * w.element_size()
                   for w in self.weights.values())


def progress_bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, dynamic_ncols=True)


def check_shape(spec: TensorSpec, shape: tuple[int, ...], where: str) -> None:
    if tuple(shape) != spec.shape:
        raise CheckpointError(f"{where}: tensor {spec.name} has shape {tuple(shape)}, expected {spec.shape}")


def check_finite(name: str, t: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{where}: tensor {name} holds NaN or infinite values")
