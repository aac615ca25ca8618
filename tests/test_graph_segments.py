"""The CUDA executor's step is captured as a few consecutive graphs (pure layer arithmetic: no GPU)."""

import pytest

from flint_sched.executor.graphs import FIRST_GRAPH_LAYERS, graph_segments


@pytest.mark.parametrize("layers", [1, 2, 7, 49])
@pytest.mark.parametrize("first", [0, 1, 3, 10, 60])
def test_segments_cover_every_layer_once_in_order(layers, first):
    segments = graph_segments(layers, first)
    assert segments[0][0] == 0 and segments[-1][1] == layers
    assert all(a < b for a, b in segments)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(segments, segments[1:], strict=False))
    assert len(segments) <= 3


def test_a_small_first_graph_then_larger_ones():
    assert graph_segments(49, 3) == [(0, 3), (3, 15), (15, 49)]
    assert graph_segments(49, 0) == [(0, 49)]
    assert graph_segments(7, 1) == [(0, 1), (1, 5), (5, 7)]
    assert graph_segments(49, FIRST_GRAPH_LAYERS)[0] == (0, FIRST_GRAPH_LAYERS)
