"""What an executor states about itself, for the scheduler and the engine builder to take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorLimits:
    """fused_max_batch: decode steps of at most this many requests take the fused path (0: the
    executor has none, every step is "grouped"). graph_batch_sizes: decode batch sizes replayed
    from CUDA graphs (a batch runs in the smallest size that holds it, padded), ascending."""

    fused_max_batch: int
    graph_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.fused_max_batch < 0:
            raise ValueError(f"fused_max_batch must be >= 0, got {self.fused_max_batch}")
        if list(self.graph_batch_sizes) != sorted(set(self.graph_batch_sizes)) or any(
                b < 1 for b in self.graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes must be ascending and positive, got {self.graph_batch_sizes}")
