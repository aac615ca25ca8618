"""CUDA graphs of steps: one set per (variant, padded rows), captured on first use.

A step is captured as a few graphs over layer ranges (`graph_segments`) so the GPU starts on the
first while the host still launches the rest. Batches of the grouped path run in the smallest
captured batch size that holds them (padded rows, as vLLM's buckets). All graphs draw their
intermediates from one memory pool: they never run at the same time, and everything that
outlives a replay (inputs, hidden state between segments, logits) is static memory outside it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

# Launching one graph of ~450 kernels takes 0.14-0.38 ms of host time on the H200 machine, and the
# GPU starts on a graph only once its launch returns; a small first graph lets it start early
# (benchmarks/RESULTS.md). Each graph boundary costs a few µs (no PDL overlap across it).
FIRST_GRAPH_LAYERS = 3
GROUPED_BATCH_SIZES = (16, 24, 32, 48, 64, 96, 128, 192, 256)
# Rows of the prompt steps (chunks and the decodes beside them) replayed from graphs. Eager, a step
# of ~1K rows takes ~49 ms of host time for ~22 ms of GPU work (H200, NVFP4; benchmarks/RESULTS.md,
# session 7); from a few thousand rows on the GPU time hides the launches and steps run eagerly.
PROMPT_GRAPH_TOKENS = (64, 128, 256, 512, 768, 1024, 1536, 2048)


def graph_segments(num_layers: int, first_graph_layers: int) -> list[tuple[int, int]]:
    """[first, last) layer ranges of the step's graphs: `first_graph_layers`, then 4x as many,
    then the rest (0: one graph). Each graph's launch (host time ~ its size) then fits in the GPU
    time of the graphs before it, and only the small first one is waited for."""
    first = first_graph_layers
    if not 0 < first < num_layers:
        return [(0, num_layers)]
    second = min(num_layers, 5 * first)
    return [(0, first), (first, second)] + ([(second, num_layers)] if second < num_layers else [])


def padded_batch(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `batch`, or None."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class StepGraphs:
    """Captured decode steps by key; `run(key, segment)` replays them, capturing on first use.

    `segment(first, last)` launches layers [first, last) of the step for the key (the same
    launches every time: it is what gets captured).
    """

    def __init__(self, device: torch.device, segments: list[tuple[int, int]]):
        self.device, self.segments = device, segments
        self.graphs: dict[tuple, list[torch.cuda.CUDAGraph]] = {}
        self.last_key: tuple | None = None
        self._pool = None

    @property
    def pool(self):
        """The memory pool of every graph here (and of the graph sampler's)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def clear(self) -> None:
        """Drop every captured graph and their pool: a pool whose graphs are all gone takes no new
        capture (torch asserts), so the next capture starts a fresh one."""
        self.graphs.clear()
        self.last_key = self._pool = None

    def run(self, key: tuple, segment: Callable[[int, int], object], replay_first: bool = True,
            segments: list[tuple[int, int]] | None = None) -> None:
        """Replay the key's graphs, capturing them first if new. A capture runs the step once
        eagerly (loading kernels and workspaces); `replay_first` False lets that run stand for the
        step, for steps that must not run twice (a prompt step reads ring rows it then overwrites).
        `segments`: this key's layer ranges, if not the set's (a step of a few launches: one)."""
        graphs = self.graphs.get(key)
        self.last_key = key
        if graphs is None:
            graphs = self.graphs[key] = self._capture(segment, segments or self.segments)
            if not replay_first:
                return
        for graph in graphs:
            graph.replay()

    def _capture(self, segment: Callable[[int, int], object],
                 segments: list[tuple[int, int]]) -> list[torch.cuda.CUDAGraph]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for first, last in segments:
                segment(first, last)              # loads every kernel and workspace before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graphs = []
        for first, last in segments:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                segment(first, last)
            graphs.append(graph)
        return graphs
