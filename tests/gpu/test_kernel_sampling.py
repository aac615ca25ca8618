"""Greedy token choice (cuda/argmax.cu) against torch.argmax: exact, including ties and NaN."""

import pytest
import torch

from flint_sched.kernels import argmax_workspace, greedy

pytestmark = pytest.mark.gpu


def logits(b: int, v: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [151552, 4097, 1000, 7])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_greedy_matches_torch_argmax(b, v, dtype, out_dtype):
    x = logits(b, v, dtype, seed=b * v)
    out = torch.full((b,), -1, dtype=out_dtype, device="cuda")
    greedy(x, out=out)
    assert torch.equal(out, torch.argmax(x, dim=-1).to(out_dtype)), f"B={b} V={v} {dtype}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_go_to_the_lowest_index(dtype):
    x = logits(4, 151552, dtype, seed=1)
    x[0] = 0.5                                        # all equal
    x[1, [70000, 5, 150000]] = 100.0                  # several maxima in different CTAs
    x[2, 151551] = 100.0                              # the very last element
    x[3, :] = float("-inf")                           # all -inf
    assert greedy(x).tolist() == [0, 5, 151551, 0]


def test_signed_zeros_tie_and_nan_wins():
    x = torch.full((2, 3000), float("-inf"), device="cuda")
    x[0, 2100], x[0, 17] = 0.0, -0.0                  # -0 == +0: the lower index
    x[1, 5], x[1, 2999], x[1, 1200] = 1.0, float("nan"), float("nan")
    assert greedy(x).tolist() == [17, 1200]


def test_strided_rows_take_the_scalar_path():
    wide = logits(3, 1003, torch.bfloat16, seed=2)
    x = wide[:, :1001]                                # row stride 1003: not 16-byte aligned
    assert torch.equal(greedy(x), torch.argmax(x, dim=-1).int())


def test_workspace_reuse_and_cuda_graph():
    b, v = 8, 151552
    x = logits(b, v, torch.bfloat16, seed=3)
    workspace = argmax_workspace(b, v, "cuda")
    out = torch.empty(b, dtype=torch.int64, device="cuda")
    greedy(x, out=out, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy(x, out=out, workspace=workspace)
    for seed in (4, 5, 6):
        x.copy_(logits(b, v, torch.bfloat16, seed=seed))
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1)), f"graph replay with seed {seed}"
    assert workspace[-1].item() == 0, "ticket not reset"
    for batch in (1, 5):                               # a smaller batch fits the same workspace
        assert torch.equal(greedy(x[:batch], workspace=workspace), torch.argmax(x[:batch], dim=-1).int())
