"""Timing kernels inside CUDA graphs, over enough rotating input sets that L2 does not hold them."""

from __future__ import annotations

import statistics

import torch

ROTATE_BYTES = 256 << 20      # > 4x the H200's 60 MB L2


def num_sets(bytes_per_set: int, max_sets: int) -> int:
    """How many copies of the inputs to rotate through so that one round reads ROTATE_BYTES."""
    return max(2, min(max_sets, -(-ROTATE_BYTES // max(1, bytes_per_set))))


def reps_for(sets: int, minimum: int = 200) -> int:
    """Launches per graph: at least `minimum`, a whole number of rounds over the sets."""
    return -(-minimum // sets) * sets


def time_graph(launches: list, reps: int, replays: int = 15) -> float:
    """Median µs per launch of a graph that runs `launches` round-robin `reps` times."""
    for launch in launches:        # compile, load, warm up outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            launches[i % len(launches)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)
