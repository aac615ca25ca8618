"""The scheduler's limits: a frozen struct, validated when built, no I/O.

fused_max_seqs comes from the executor (`executor.limits.fused_max_batch`): decode steps of at most
that many requests are planned on the fused path.

max_num_seqs is also the number of ring slots, and max_num_batched_tokens >= max_num_seqs so that
every running decode always fits one step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine; max_num_seqs is also the number of ring slots."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    max_model_len: int
    block_size: int = 16
    sliding_window: int = 513
    fused_max_seqs: int = 0      # the executor's limits.fused_max_batch (0: it has no fused path)
    enable_prefix_caching: bool = False
    num_ring_snapshots: int = 0  # ring slots kept for prefix-cache snapshots, after the max_num_seqs ones
    prefix_cache_key: str = ""   # what else changes the KV (model, revision): part of every block key
    long_prefill_token_threshold: int = 0  # > 0: a prompt advances at most this many tokens a step (vLLM's)

    def __post_init__(self) -> None:
        minimums = {
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "num_blocks": 1,
            "max_model_len": 2,
            "block_size": 1,
            "sliding_window": 1,
            "fused_max_seqs": 0,
            "num_ring_snapshots": 0,
            "long_prefill_token_threshold": 0,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.num_ring_snapshots < 1:
            raise ValueError("prefix caching needs num_ring_snapshots >= 1 (a hit restores the sliding "
                             "layers' rings from a snapshot)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that every running decode fits a step"
            )
