"""The persistent GEMV chains (cuda/gemv_chain.cu, benchmarks/bench_persistent.py): their layers wait
on counters instead of kernel boundaries, with the weights read from global memory or streamed into
a shared-memory ring by a producer warp, and must give the launched chain's result bit for bit, in a
graph replayed twice too (the counters are zeroed before each launch)."""

import pytest
import torch

from flint_sched.benchmarks.bench_persistent import gemv_chain, gemv_chain_ring, launched_chain
from flint_sched.quant.nvfp4 import quantize
from gpu_checks import gen

pytestmark = pytest.mark.gpu
N = 2048


CHAINS = [pytest.param(lambda h, w, done, warps=warps, s=sleep_ns, a=acq_rel: gemv_chain(h, w, done, warps, s, a),
                       warps, id=f"counters-{warps}w-{sleep_ns}ns{'-acq_rel' if acq_rel else ''}")
          for warps, sleep_ns, acq_rel in [(8, 0, False), (16, 0, False), (16, 64, False), (16, 0, True)]]
# 2 stages over 7 layers: every stage is reused three times (the producer waits on `empty`)
CHAINS += [pytest.param(lambda h, w, done, warps=warps, st=stages: gemv_chain_ring(h, w, done, warps, st),
                        warps, id=f"ring-{warps}w-{stages}st") for warps, stages in [(16, 2), (8, 4), (16, 8)]]


@pytest.mark.parametrize("chain,warps", CHAINS)
def test_the_persistent_chain_equals_the_launched_one(chain, warps):
    layers = 7
    w = quantize(torch.randn(layers, N, N, device="cuda", generator=gen(5)) / N**0.5, per_leading_scale=True)
    x = torch.randn(N, device="cuda", generator=gen(6)).bfloat16()
    expected = torch.zeros(layers + 1, N, dtype=torch.bfloat16, device="cuda")
    expected[0] = x
    launched_chain(expected, w, warps, pdl=True)
    assert expected[-1].abs().max() > 0 and torch.isfinite(expected.float()).all()
    h = torch.full_like(expected, float("nan"))
    h[0] = x
    done = torch.zeros(layers, dtype=torch.int32, device="cuda")
    chain(h, w, done)
    torch.cuda.synchronize()
    assert torch.equal(h, expected)
    assert done.tolist() == [N // 16] * layers
    graph = torch.cuda.CUDAGraph()
    h[1:] = float("nan")
    with torch.cuda.graph(graph):
        chain(h, w, done)
    for _ in range(2):
        h[1:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, expected)


def test_a_grid_that_cannot_be_resident_is_refused():
    from flint_sched.kernels.linear import resident_ctas

    tiles = -(-(resident_ctas(16, "nvfp4") + 1) // 4) * 4      # one CTA too many, N a multiple of 64
    n = 16 * tiles
    w = quantize(torch.randn(1, n, n, device="cuda", generator=gen(7)) / n**0.5, per_leading_scale=True)
    with pytest.raises(ValueError, match="do not fit"):
        gemv_chain(torch.zeros(2, n, dtype=torch.bfloat16, device="cuda"), w,
                   torch.zeros(1, dtype=torch.int32, device="cuda"), 16)
