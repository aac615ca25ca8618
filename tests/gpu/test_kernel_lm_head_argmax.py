"""The LM head with its greedy choice in one launch (kernels/linear.py `argmax_out`, cuda/gemv.cu
gemv_*_argmax): the logits bit for bit those of the plain GEMV, the ids torch.argmax's of them
(ties and NaN to the lowest index), the workspace left zeroed for the next launch and graph replay."""

import pytest
import torch

from flint_sched.kernels import linear
from flint_sched.kernels.sampling import pick_workspace
from flint_sched.quant.nvfp4 import quantize
from gpu_checks import gen, poisoned

pytestmark = pytest.mark.gpu


def weight(fmt: str, n: int, k: int, seed: int):
    w = torch.randn(n, k, device="cuda", generator=gen(seed)) / k**0.5
    return quantize(w) if fmt == "nvfp4" else w.bfloat16()


def activations(b: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(b, k, device="cuda", generator=gen(seed)).bfloat16()


def folded(x, w, ids_dtype=torch.int32, workspace=None, active=None, ids=None, warps=None):
    b, n = x.shape[0], w.shape[0]
    ids = torch.full((b,), -7, dtype=ids_dtype, device="cuda") if ids is None else ids
    workspace = pick_workspace(32, "cuda") if workspace is None else workspace
    y = linear(x, w, out=poisoned(b, n), argmax_out=ids, argmax_workspace=workspace, argmax_active=active,
               warps=warps)
    return y, ids, workspace


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("n,k", [(151552, 2048), (1000, 192), (37, 64)])
@pytest.mark.parametrize("b", [1, 3, 8, 9, 16, 17, 32])
def test_the_folded_argmax_is_torch_argmax_of_the_same_logits(fmt, n, k, b):
    w, x = weight(fmt, n, k, seed=n + k), activations(b, k, seed=b)
    y, ids, workspace = folded(x, w)
    assert torch.equal(y, linear(x, w, out=poisoned(b, n)))           # the GEMV's own bits
    assert torch.equal(ids.long(), torch.argmax(y, dim=-1)), f"{fmt} B={b} N={n}"
    assert not workspace.any()                                        # left zeroed for the next launch


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("warps", [4, 8, 16])
@pytest.mark.parametrize("n,b", [(1000, 1), (37, 9), (1000, 16), (4096, 17)])
def test_every_warp_count_meets_at_its_barrier(fmt, warps, n, b):
    """4, 8 and 16 warps a CTA (warps 4 and up leave before the CTA's choice; rows past N stay in it):
    the same logits and ids as the plain GEMV's and torch.argmax's."""
    if warps == 16 and b > 16:
        pytest.skip("16 warps take at most two 8-token groups")
    w, x = weight(fmt, n, 256, seed=n + warps), activations(b, 256, seed=b + warps)
    y, ids, workspace = folded(x, w, warps=warps)
    assert torch.equal(y, linear(x, w, out=poisoned(b, n), warps=warps))
    assert torch.equal(ids.long(), torch.argmax(y, dim=-1)) and not workspace.any(), f"{fmt} {warps} warps"


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_ties_nan_and_infinities_go_where_torch_argmax_puts_them(ids_dtype):
    """y with ties across CTAs (the lowest index), +inf, -inf and all zeros; then NaN (the maximum: the
    first one). The infinities come from products past fp32's range (1e20 * 1e20), which only the rows
    whose activations are 1e20 see (a 0 * 1e20 elsewhere is 0). The NaN comes from the weights: an
    inf - inf inside one tensor-core MMA gives 0, not NaN (the products are aligned to the largest)."""
    n, k, big = 4096, 64, 1e20
    w = torch.zeros(n, k, device="cuda")
    x = torch.zeros(6, k, device="cuda")
    w[:, 0] = -1.0
    w[[700, 3000, 3001], 0] = 5.0
    w[[900, 2500], 1] = big
    w[[123, 4000], 2] = 6.0
    x[0, 0] = 1.0                                 # -1, 5 at 700, 3000, 3001: 700
    x[1, 0], x[1, 1] = 1.0, big                   # +inf at 900 and 2500: 900
    x[2, 0], x[2, 2] = 1.0, 1.0                   # 5 at 123, 700, 3000, 3001, 4000: 123
    x[4, 0] = -1.0                                # +1 everywhere but -5 at 700, 3000, 3001: 0
    x[5, 1] = -big                                # -inf at 900 and 2500, 0 elsewhere: 0
    y, ids, workspace = folded(x.bfloat16(), w.bfloat16(), ids_dtype)
    assert y[1, 900] == float("inf") and y[5, 900] == float("-inf") and not y[3].any()
    assert torch.equal(ids.long(), torch.argmax(y, dim=-1)), (ids, torch.argmax(y, dim=-1))
    assert ids.tolist() == [700, 900, 123, 0, 0, 0]
    w[[2500, 4000], 3] = float("nan")             # NaN at 2500 and 4000 in every token: 2500
    y, ids, _ = folded(x.bfloat16(), w.bfloat16(), ids_dtype, workspace=workspace)
    assert y[:, [2500, 4000]].isnan().all() and y[:, :2500].isnan().sum() == 0
    assert torch.equal(ids.long(), torch.argmax(y, dim=-1)) and ids.tolist() == [2500] * 6


def test_an_all_sampling_step_leaves_the_ids_and_the_workspace_as_they_were():
    w, x = weight("bf16", 1000, 192, seed=1), activations(4, 192, seed=2)
    active = torch.zeros(1, dtype=torch.int32, device="cuda")
    y, ids, workspace = folded(x, w, active=active)
    assert torch.equal(y, linear(x, w, out=poisoned(4, 1000)))
    assert (ids == -7).all() and not workspace.any()
    active.fill_(1)
    folded(x, w, active=active, ids=ids, workspace=workspace)
    assert torch.equal(ids.long(), torch.argmax(y, dim=-1)) and not workspace.any()


def test_graph_replays_choose_anew_each_time():
    """Captured with PDL after another GEMV: each replay's ids are the argmax of that replay's logits."""
    k, n = 2048, 151552
    w0, w = weight("nvfp4", k, k, seed=3), weight("bf16", n, k, seed=4)
    x = activations(4, k, seed=5)
    h, y = poisoned(4, k), poisoned(4, n)
    ids = torch.zeros(4, dtype=torch.int64, device="cuda")
    workspace = pick_workspace(8, "cuda")

    def step():
        linear(x, w0, out=h, pdl=True)
        linear(h, w, out=y, pdl=True, argmax_out=ids, argmax_workspace=workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (6, 7, 8):
        x.copy_(activations(4, k, seed=seed))
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, linear(h, w, out=poisoned(4, n)))
        assert torch.equal(ids, torch.argmax(y, dim=-1)) and not workspace.any(), seed


def test_rejects_bad_arguments():
    w, x = weight("bf16", 64, 64, seed=0), activations(2, 64, seed=0)
    ids, workspace = torch.zeros(2, dtype=torch.int32, device="cuda"), pick_workspace(2, "cuda")
    bad = [dict(argmax_out=ids.float(), argmax_workspace=workspace),                   # ids not integer
           dict(argmax_out=torch.zeros(3, dtype=torch.int32, device="cuda"), argmax_workspace=workspace),
           dict(argmax_out=ids, argmax_workspace=None),
           dict(argmax_out=ids, argmax_workspace=pick_workspace(1, "cuda")),             # too small for 2 rows
           dict(argmax_out=ids, argmax_workspace=workspace.int()),
           dict(argmax_out=ids, argmax_workspace=workspace, argmax_active=torch.zeros(1, device="cuda")),
           dict(argmax_out=ids, argmax_workspace=workspace, residual=torch.zeros(2, 64, device="cuda").bfloat16()),
           dict(argmax_out=ids, argmax_workspace=workspace, norm_weight=torch.ones(64, device="cuda").bfloat16()),
           dict(argmax_out=ids, argmax_workspace=workspace, out_dtype=torch.float32)]
    for kw in bad:
        with pytest.raises(ValueError):
            linear(x, w, **kw)
