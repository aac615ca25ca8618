"""moe_fused (cuda/moe_fused.cu): a fused decode step's MoE block in one launch, bit for bit the
three launches it stands for: the router that normalizes (`route(..., norm_weight=)`), `moe_gate_up`
and `moe_down` (themselves checked against the reference in test_kernel_moe.py). NVFP4 experts
through shared-memory slots and read from global memory, BF16 experts; Flint's shapes and small
real-shaped layers, 1-8 rows, with and without the shared expert, the grid as large as the GPU holds
and small enough that every CTA takes many tiles (through its rings), repeated launches and a CUDA
graph (the counters reset themselves)."""

import importlib

import pytest
import torch

from flint_sched.kernels.linear import weight_format
from flint_sched.kernels.moe import fused_moe_bytes, moe_down, moe_fused, moe_gate_up, route
from flint_sched.kernels.smem_tiles import grid_counters
from gpu_checks import gen, poisoned
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize
from moe_checks import make_moe

moe_kernels = importlib.import_module("flint_sched.kernels.moe")   # the package exports a function `moe`

pytestmark = pytest.mark.gpu

FLINT = dict(experts=256, top_k=6, hidden=2048, inter=512)
SMALL = dict(experts=32, top_k=6, hidden=512, inter=512)     # tests/gpu/gpu_checks.py small_real_config
NARROW = dict(experts=32, top_k=4, hidden=512, inter=256)    # 2 k-steps a down row: a pass is 8 experts
SCALING, EPS = 2.5, 1e-5


LAYERS = [("nvfp4", FLINT), ("nvfp4", SMALL), ("nvfp4", NARROW), ("bf16", FLINT), ("bf16", SMALL)]


@pytest.fixture(scope="module", params=LAYERS, ids=[f"{f}-{n}" for f, n in
                                                   zip(["nvfp4"] * 3 + ["bf16"] * 2, ["flint", "small", "narrow"] * 2)])
def weights(request):
    fmt, shape = request.param
    p = make_moe(fmt, shape, seed=7)
    p["norm"] = (1 + 0.2 * torch.randn(shape["hidden"], device="cuda", generator=gen(8))).bfloat16()
    return fmt, shape, p


@pytest.fixture(params=["slots", "direct"])
def layer(request, weights, monkeypatch):
    """The layer's shape and weights, NVFP4 through the slots kernel or the direct one (BF16: direct)."""
    fmt, shape, p = weights
    if fmt == "bf16" and request.param == "slots":
        pytest.skip("BF16 experts are read from global memory only")
    monkeypatch.setattr(moe_kernels, "FUSED_NVFP4_SLOTS", request.param == "slots")
    return shape, p


def rows(tokens, hidden, seed, same=False):
    x = (4 * torch.randn(1 if same else tokens, hidden, device="cuda", generator=gen(seed))).bfloat16()
    return x.expand(tokens, hidden).contiguous() if same else x


def three_launches(x, shape, p, shared):
    normed = torch.empty_like(x)
    ids, weights = route(x, p["router"], p["bias"], shape["top_k"], SCALING, cluster=True, norm_weight=p["norm"],
                         norm_eps=EPS, normed=normed)
    s = (p["shared_gate"], p["shared_up"], p["shared_down"]) if shared else (None, None, None)
    h = moe_gate_up(normed, ids, p["gate"], p["up"], s[0], s[1])
    y = moe_down(h, ids, weights, p["down"], s[2], residual=x)
    return ids, weights, h, y


def one_launch(x, shape, p, shared, counters, pdl=False):
    t, a, i = x.shape[0], shape["top_k"], shape["inter"]
    s = (p["shared_gate"], p["shared_up"], p["shared_down"]) if shared else (None, None, None)
    h, ids = poisoned(t, a + 1, i), torch.full((t, a), -1, dtype=torch.int32, device="cuda")
    weights = torch.full((t, a), float("nan"), device="cuda")
    y = moe_fused(x, p["norm"], EPS, p["router"], p["bias"], a, SCALING, p["gate"], p["up"], p["down"], *s,
                  counters, residual=x, out=poisoned(t, shape["hidden"]), h=h, ids=ids, weights=weights, pdl=pdl)
    return ids, weights, h, y


def check_same(got, want, shared, what):
    ids, weights, h, y = got
    want_ids, want_weights, want_h, want_y = want
    assert torch.equal(ids, want_ids), f"{what}: ids {ids.tolist()} against {want_ids.tolist()}"
    assert torch.equal(weights, want_weights), f"{what}: routing weights differ"
    slots = h.shape[1] if shared else h.shape[1] - 1        # without a shared expert h[:, A] is not written
    assert torch.equal(h[:, :slots], want_h[:, :slots]), \
        f"{what}: h differs in {(h[:, :slots] != want_h[:, :slots]).sum()} of {h[:, :slots].numel()} values"
    assert torch.equal(y, want_y), f"{what}: y differs in {(y != want_y).sum()} of {y.numel()} values"


@pytest.mark.parametrize("shared", [True, False], ids=["shared-expert", "no-shared-expert"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 6, 8])
def test_one_launch_is_the_three_launches_bit_for_bit(layer, tokens, shared):
    shape, p = layer
    assert fused_moe_bytes(shape["experts"], shape["hidden"], shape["inter"], tokens, shape["top_k"],
                           moe_kernels.fused_slots(weight_format(p["gate"]))) is not None
    x = rows(tokens, shape["hidden"], seed=tokens)
    counters = grid_counters("cuda")
    want = three_launches(x, shape, p, shared)
    for launch in range(3):
        check_same(one_launch(x, shape, p, shared, counters, pdl=launch > 0), want, shared,
                   f"T={tokens} launch {launch}")
        assert counters.tolist() == [0, 0], "the last CTA through leaves the counters zero"


@pytest.mark.parametrize("tokens,clusters", [(1, None), (8, None), (3, 1)])
def test_the_scores_by_st_async_change_nothing(layer, tokens, clusters, monkeypatch):
    """kernels/moe.py ROUTER_ST_ASYNC: every CTA of a cluster gets the router's scores by st.async,
    counted on its own mbarrier, instead of DSMEM stores and a cluster barrier: the same bits, on the
    whole grid and on one cluster, repeated (PDL) and in a graph."""
    shape, p = layer
    if clusters is not None:
        monkeypatch.setattr(moe_kernels, "_fused_clusters", lambda kernel, size, device: clusters)
    x = rows(tokens, shape["hidden"], seed=40 + tokens)
    counters = grid_counters("cuda")
    monkeypatch.setattr(moe_kernels, "ROUTER_ST_ASYNC", False)
    want = three_launches(x, shape, p, True)
    monkeypatch.setattr(moe_kernels, "ROUTER_ST_ASYNC", True)
    for launch in range(2):
        check_same(one_launch(x, shape, p, True, counters, pdl=launch > 0), want, True, f"T={tokens} st.async")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_launch(x, shape, p, True, counters, pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    check_same(out, want, True, f"T={tokens} st.async, graph")
    assert counters.tolist() == [0, 0]


@pytest.mark.parametrize("st_async", [False, True], ids=["dsmem", "st_async"])
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_a_cluster_cta_without_experts_still_gets_every_score(fmt, st_async, monkeypatch):
    """13 experts over a cluster of 8 CTAs of 2 rows: the last holds none and sends no score, but
    routes too (every CTA waits for all 13 x T scores)."""
    shape = dict(experts=13, top_k=4, hidden=256, inter=256)
    p = make_moe(fmt, shape, seed=9)
    p["norm"] = (1 + 0.2 * torch.randn(256, device="cuda", generator=gen(10))).bfloat16()
    monkeypatch.setattr(moe_kernels, "ROUTER_ST_ASYNC", st_async)
    for tokens in (1, 3, 8):
        x = rows(tokens, 256, seed=50 + tokens)
        want = three_launches(x, shape, p, True)
        check_same(one_launch(x, shape, p, True, grid_counters("cuda")), want, True, f"E=13 T={tokens}")


@pytest.mark.parametrize("down_early", [1, 0], ids=["down-early", "down-late"])
@pytest.mark.parametrize("clusters", [1, 2, 3])
@pytest.mark.parametrize("tokens,same", [(1, False), (6, False), (8, True)], ids=["1", "6", "8-same-rows"])
def test_a_small_grid_takes_many_tiles_through_its_rings(layer, tokens, same, clusters, down_early, monkeypatch):
    """8-24 CTAs: each takes tens of gate/up tiles and several down tiles of 16 outputs, refilling its
    rings of weight slots as it goes (at 8 rows of one token, every row chose the same experts); the
    down ring asked for with gate/up's or after the first gate/up round (FUSED_DOWN_EARLY)."""
    shape, p = layer
    if not down_early and not moe_kernels.fused_slots(weight_format(p["gate"])):
        pytest.skip("only the slots kernel has a down ring")
    monkeypatch.setattr(moe_kernels, "_fused_clusters", lambda kernel, size, device: clusters)
    monkeypatch.setattr(moe_kernels, "FUSED_DOWN_EARLY", down_early)
    x = rows(tokens, shape["hidden"], seed=20 + tokens, same=same)
    want = three_launches(x, shape, p, True)
    check_same(one_launch(x, shape, p, True, grid_counters("cuda")), want, True,
               f"T={tokens} on {clusters} clusters")


def test_in_a_cuda_graph_replays_bit_for_bit(layer):
    shape, p = layer
    x = rows(4, shape["hidden"], seed=30)
    counters = grid_counters("cuda")
    want = three_launches(x, shape, p, True)
    eager = one_launch(x, shape, p, True, counters, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [one_launch(x, shape, p, True, counters, pdl=True) for _ in range(2)]   # back to back
    for _ in range(3):
        for out in outs:
            for t in out:
                t.fill_(-1 if t.dtype == torch.int32 else float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            check_same(out, want, True, "graph replay")
    check_same(eager, want, True, "eager")
    assert counters.tolist() == [0, 0]


def test_bad_arguments_are_refused_before_the_launch(layer):
    shape, p = layer
    x = rows(2, shape["hidden"], seed=1)
    counters = grid_counters("cuda")
    args = (p["norm"], EPS, p["router"], p["bias"], shape["top_k"], SCALING, p["gate"], p["up"], p["down"])
    with pytest.raises(ValueError, match="all of shared_gate"):
        moe_fused(x, *args, p["shared_gate"], None, p["shared_down"], counters)
    with pytest.raises(ValueError, match="out must not be x"):
        moe_fused(x, *args, None, None, None, counters, out=x)
    with pytest.raises(ValueError, match="9 tokens"):
        moe_fused(rows(9, shape["hidden"], seed=2), *args, None, None, None, counters)
    with pytest.raises(ValueError, match="mixing NVFP4 and bf16"):
        moe_fused(x, *args, p["shared_gate"], p["shared_up"], _other_format(p["shared_down"]), counters)
    with pytest.raises(ValueError, match="counters"):
        moe_fused(x, *args, None, None, None, torch.zeros(2, dtype=torch.int64, device="cuda"))
    t, a, i = 2, shape["top_k"], shape["inter"]
    unaligned = torch.empty(t * (a + 1) * i + 1, dtype=torch.bfloat16, device="cuda")[1:].view(t, a + 1, i)
    with pytest.raises(ValueError, match="h must start at a 16-byte"):
        moe_fused(x, *args, None, None, None, counters, h=unaligned)
    if isinstance(p["down"], NVFP4Tensor) and moe_kernels.FUSED_NVFP4_SLOTS:   # a bulk copy's source
        w = p["down"]
        shifted = torch.empty(w.block_scales.numel() + 2, dtype=torch.uint8, device="cuda")[2:]
        moved = NVFP4Tensor(w.codes, shifted.view(w.block_scales.shape).copy_(w.block_scales), w.tensor_scale)
        with pytest.raises(ValueError, match="block_scales must start at a 16-byte"):
            moe_fused(x, *args[:-1], moved, None, None, None, counters)


def _other_format(w):
    """The weight in the other format (a mixed call must be refused)."""
    return w.dequantize(torch.bfloat16) if isinstance(w, NVFP4Tensor) else quantize(w.float())
