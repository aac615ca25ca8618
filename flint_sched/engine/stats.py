"""A snapshot of the engine's state for /metrics: what the scrape reads, in one value.

The server's collector (api/metrics.py EngineCollector) turns it into vLLM-named gauges and counters.
Taking it from the engine in one call keeps the API side off the scheduler's and executor's
internals, so the snapshot could as well come from an engine in another process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuStats:
    """The CUDA executor's GPU timeline (executor/gpu_timeline.py), cumulative seconds."""

    busy_s: float
    prompt_busy_s: float
    idle_s: float
    stalled_s: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_block_usage: float          # full-attention KV blocks in use, 0..1
    ring_slot_usage: float         # sliding-window ring slots in use, 0..1
    num_used_blocks: int
    num_total_blocks: int
    block_size: int
    cache_dtype: str               # vLLM's label: "fp8_e4m3" for an e4m3 cache, else "auto"
    num_ring_slots: int
    enable_prefix_caching: bool
    num_preemptions: int
    prefix_cache_queries: int      # tokens
    prefix_cache_hits: int         # tokens
    gpu: GpuStats | None           # None without a GPU timeline
