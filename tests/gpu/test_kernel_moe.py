"""Router and small-batch MoE kernels (cuda/router.cu, cuda/moe.cu) against model/reference.py.

Expert kernels are checked against an fp32 reference built from the same ids (so router near-ties
cannot blur an expert-kernel failure), then end to end against `FlintReference.moe`.
"""

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from flint_sched.checkpoint.random_init import random_tensor
from flint_sched.config import preset
from flint_sched.kernels import moe, moe_down, moe_gate_up, route, router_workspace
from flint_sched.kernels.moe import moe_split, router_normalizes
from flint_sched.kernels.norm import add_rms_norm_fixed, rms_norm
from flint_sched.model.reference import FlintReference
from flint_sched.model.reference import route as reference_route
from flint_sched.model.weights import tensor_specs
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize
from gpu_checks import assert_close_bf16 as close_bf16
from gpu_checks import gen

moe_kernels = importlib.import_module("flint_sched.kernels.moe")   # the package exports a function `moe`

pytestmark = pytest.mark.gpu

REAL = dict(experts=256, top_k=6, hidden=2048, inter=512)
TINY = dict(experts=16, top_k=4, hidden=64, inter=64)
ODD = dict(experts=13, top_k=5, hidden=96, inter=64)     # cluster router: its last CTA holds no expert
SCALING = 2.5


def assert_close_bf16(out, ref, what, rtol=2.0**-6, rel_l2=1e-2):
    """MoE sums several bf16 products: a looser bound than a single GEMV."""
    close_bf16(out, ref, what, rtol=rtol, abs_frac=1e-2, rel_l2=rel_l2)




def make_experts(fmt: str, experts: int, hidden: int, inter: int, seed: int = 0) -> dict:
    """Stacked expert weights and the shared expert, bf16 or NVFP4 (one tensor scale per expert)."""
    g = gen(seed)

    def w(*shape):
        x = torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5
        if fmt == "bf16":
            return x.bfloat16()
        return quantize(x, per_leading_scale=len(shape) == 3)

    return dict(gate=w(experts, inter, hidden), up=w(experts, inter, hidden), down=w(experts, hidden, inter),
                shared_gate=w(inter, hidden), shared_up=w(inter, hidden), shared_down=w(hidden, inter))


def dense(w, ids=None) -> torch.Tensor:
    if isinstance(w, NVFP4Tensor):
        if ids is not None:
            w = NVFP4Tensor(w.codes[ids], w.block_scales[ids], w.tensor_scale[ids])
        return w.dequantize(torch.float32)
    return (w[ids] if ids is not None else w).float()


def distinct_ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Per token top_k distinct experts; tokens share some experts (token b+1 reuses two of b's)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    for b in range(1, tokens):
        shared = rows[b - 1][:2]
        rest = [e for e in rows[b].tolist() if e not in shared.tolist()][: top_k - 2]
        rows[b] = torch.tensor(shared.tolist() + rest)
    return torch.stack(rows).int().cuda()


def expert_reference(x, ids, weights, p, residual=None):
    """h [T, A+1, I] and y [T, H] in fp32 from the same ids/weights (the kernels' contract)."""
    xf = x.float()
    t, a = ids.shape
    gate, up, down = dense(p["gate"], ids.flatten().long()), dense(p["up"], ids.flatten().long()), \
        dense(p["down"], ids.flatten().long())
    inter = gate.shape[1]
    h = torch.empty(t, a + 1, inter, device="cuda")
    y = torch.zeros(t, down.shape[1], device="cuda")
    for b in range(t):
        for s in range(a):
            j = b * a + s
            h[b, s] = F.silu(gate[j] @ xf[b]) * (up[j] @ xf[b])
            y[b] += weights[b, s] * (down[j] @ h[b, s].bfloat16().float())
        h[b, a] = F.silu(dense(p["shared_gate"]) @ xf[b]) * (dense(p["shared_up"]) @ xf[b])
        y[b] += dense(p["shared_down"]) @ h[b, a].bfloat16().float()
    if residual is not None:
        y += residual.float()
    return h, y


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def real_experts(request):
    return request.param, make_experts(request.param, REAL["experts"], REAL["hidden"], REAL["inter"], seed=1)


# ---- router ----------------------------------------------------------------------------------


def check_router(x, gate, bias, top_k, ids, weights, what):
    """Same chosen set per token as route() (a differing pair must be a near-tie), same weights."""
    ref_ids, ref_w = reference_route(x.float(), gate.float(), bias, top_k, SCALING)
    selection = torch.sigmoid(x.float() @ gate.float().t()) + bias
    for b in range(x.shape[0]):
        got, want = set(ids[b].tolist()), set(ref_ids[b].tolist())
        for e_got, e_want in zip(sorted(got - want), sorted(want - got)):
            gap = abs(float(selection[b, e_got] - selection[b, e_want]))
            assert gap < 1e-5, (f"{what}: token {b} chose expert {e_got} instead of {e_want} "
                                f"(selection values differ by {gap:.3e}, not a tie)")
        if got == want:
            mine = weights[b][[ids[b].tolist().index(e) for e in ref_ids[b].tolist()]]
            torch.testing.assert_close(mine, ref_w[b], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: token {b} weights: {m}")
        assert len(got) == top_k, f"{what}: token {b} chose duplicate experts {ids[b].tolist()}"


@pytest.fixture(params=[False, True], ids=["dsmem", "st_async"])
def router_st_async(request, monkeypatch):
    """The cluster router's scores to CTA 0 by DSMEM stores and a cluster barrier, or by st.async
    counted on CTA 0's mbarrier (kernels/moe.py ROUTER_ST_ASYNC)."""
    monkeypatch.setattr(moe_kernels, "ROUTER_ST_ASYNC", request.param)
    return request.param


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "ticket"])
@pytest.mark.parametrize("shape", [REAL, TINY, ODD], ids=["real", "tiny", "odd"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_router_matches_reference(tokens, shape, cluster, router_st_async):
    """Both router kernels: the one-cluster one (gate in shared memory) and the ticket one."""
    if router_st_async and not cluster:
        pytest.skip("st.async is the cluster router's")
    e, k = shape["experts"], shape["hidden"]
    g = gen(tokens)
    x = torch.randn(tokens, k, device="cuda", generator=g).bfloat16()
    gate = (torch.randn(e, k, device="cuda", generator=g) / k**0.5).bfloat16()
    bias = 0.1 * torch.randn(e, device="cuda", generator=g)
    workspace = router_workspace(e, "cuda")
    ids = torch.full((tokens, shape["top_k"]), -1, dtype=torch.int32, device="cuda")
    weights = torch.full((tokens, shape["top_k"]), float("nan"), device="cuda")
    route(x, gate, bias, shape["top_k"], SCALING, ids=ids, weights=weights, workspace=workspace, cluster=cluster)
    check_router(x, gate, bias, shape["top_k"], ids, weights, f"router T={tokens} E={e} cluster={cluster}")
    again = route(x, gate, bias, shape["top_k"], SCALING, workspace=workspace, cluster=cluster)  # ticket reset
    assert torch.equal(again[0], ids) and torch.equal(again[1], weights), "router is not deterministic"
    assert workspace[-1:].view(torch.int32).item() == 0, "ticket not reset"


@pytest.mark.parametrize("shape", [REAL, TINY, ODD], ids=["real", "tiny", "odd"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
def test_router_that_normalizes_matches_the_norm_then_the_router(tokens, shape, router_st_async):
    """route(h, ..., norm_weight=): the norm before the MoE inside the cluster router. Its normed rows
    are the norm kernel's bit for bit, and so are the ids and weights of routing those rows."""
    e, k = shape["experts"], shape["hidden"]
    if not router_normalizes(e, k, tokens):
        pytest.skip(f"the cluster router does not take {e} x {k}")
    g = gen(tokens + 40)
    h = (4 * torch.randn(tokens, k, device="cuda", generator=g)).bfloat16()
    norm_weight = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    gate = (torch.randn(e, k, device="cuda", generator=g) / k**0.5).bfloat16()
    bias = 0.1 * torch.randn(e, device="cuda", generator=g)
    want = rms_norm(h, norm_weight, 1e-5)
    want_ids, want_weights = route(want, gate, bias, shape["top_k"], SCALING, cluster=True)
    normed = torch.full_like(h, float("nan"))
    ids, weights = route(h, gate, bias, shape["top_k"], SCALING, norm_weight=norm_weight, norm_eps=1e-5,
                         normed=normed)
    assert torch.equal(normed, want), f"normed rows differ from rms_norm's in {(normed != want).sum()} values"
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    with pytest.raises(ValueError, match="normed must not be x"):
        route(h, gate, bias, shape["top_k"], SCALING, norm_weight=norm_weight, normed=h)


# ---- experts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("down_warps", [16, 8, 4])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_experts_real_shapes(real_experts, tokens, down_warps, monkeypatch):
    """Gate/up, then down on CTAs of `down_warps` warps (kernels/moe.py DOWN_WARPS)."""
    monkeypatch.setattr(moe_kernels, "DOWN_WARPS", down_warps)
    fmt, p = real_experts
    a, hidden, inter = REAL["top_k"], REAL["hidden"], REAL["inter"]
    g = gen(100 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    ids = distinct_ids(tokens, a, REAL["experts"], seed=tokens)
    weights = torch.rand(tokens, a, device="cuda", generator=g)
    h_ref, y_ref = expert_reference(x, ids, weights, p, residual)
    h = moe_gate_up(x, ids, p["gate"], p["up"], p["shared_gate"], p["shared_up"],
                    out=torch.full((tokens, a + 1, inter), float("nan"), device="cuda", dtype=torch.bfloat16))
    assert_close_bf16(h, h_ref, f"{fmt} moe_gate_up T={tokens}", rtol=2.0**-7, rel_l2=5e-3)
    y = moe_down(h, ids, weights, p["down"], p["shared_down"], residual=residual,
                 out=torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16))
    assert_close_bf16(y, y_ref, f"{fmt} moe_down T={tokens}")


@pytest.fixture(scope="module")
def real_nvfp4_experts():
    return make_experts("nvfp4", REAL["experts"], REAL["hidden"], REAL["inter"], seed=1)


@pytest.mark.parametrize("tokens,same_ids", [(1, False), (2, False), (4, False), (3, True), (8, False)])
def test_the_staged_gate_up_is_the_plain_one_bit_for_bit(real_nvfp4_experts, tokens, same_ids, monkeypatch):
    """moe_gate_up_staged_nvfp4 (kernels/moe.py STAGED_GATE_UP) against the plain kernel: the same
    bits, eager and in a graph replayed after a PDL launch, with the down behind it; the plain ones
    against the fp32 reference. With same_ids every token picks the same experts (three tokens'
    slots on one tile)."""
    p, a, hidden = real_nvfp4_experts, REAL["top_k"], REAL["hidden"]
    g = gen(200 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    ids = (distinct_ids(1, a, REAL["experts"], seed=5).repeat(tokens, 1) if same_ids
           else distinct_ids(tokens, a, REAL["experts"], seed=tokens))
    weights = torch.rand(tokens, a, device="cuda", generator=g)
    h_ref, y_ref = expert_reference(x, ids, weights, p, residual)
    monkeypatch.setattr(moe_kernels, "STAGED_GATE_UP", False)
    h = moe_gate_up(x, ids, p["gate"], p["up"], p["shared_gate"], p["shared_up"])
    plain = moe_down(h, ids, weights, p["down"], p["shared_down"], residual=residual)
    assert_close_bf16(h, h_ref, f"moe_gate_up T={tokens}", rtol=2.0**-7, rel_l2=5e-3)
    assert_close_bf16(plain, y_ref, f"moe_down T={tokens}")
    monkeypatch.setattr(moe_kernels, "STAGED_GATE_UP", True)
    h_out = torch.full_like(h, float("nan"))
    out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)

    def experts():
        moe_gate_up(x, ids, p["gate"], p["up"], p["shared_gate"], p["shared_up"], out=h_out, pdl=True)
        moe_down(h_out, ids, weights, p["down"], p["shared_down"], residual=residual, out=out, pdl=True)

    experts()
    torch.cuda.synchronize()
    assert torch.equal(h_out, h) and torch.equal(out, plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts()
    for _ in range(2):
        h_out.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_out, h) and torch.equal(out, plain)


SMALL_SPLIT = dict(experts=24, top_k=4, hidden=512, inter=256)   # 2 chunks of 128, 4 down tiles a CTA


@pytest.mark.parametrize("tokens,same_ids,shared", [(1, False, True), (2, False, True), (4, False, True),
                                                    (3, True, True), (8, False, True), (5, False, False)])
@pytest.mark.parametrize("shape", ["real", "small"])
def test_moe_split_sums_what_the_two_launches_do(real_nvfp4_experts, shape, tokens, same_ids, shared):
    """moe_split (gate/up and down in one launch, each cluster's share of down added into a
    fixed-point accumulator by integer atomics; kernels/moe.py), then the norm that adds the residual
    and zeroes the accumulator (add_rms_norm_fixed): against the fp32 reference as close as the two
    launches are, the accumulator zero again after, and the same bits in graph replays after PDL
    launches as eager (the atomics' order does not matter). same_ids: every token picks the same
    experts."""
    if shape == "real":
        p, dims = real_nvfp4_experts, REAL
    else:
        dims = SMALL_SPLIT
        p = make_experts("nvfp4", dims["experts"], dims["hidden"], dims["inter"], seed=11)
    a, hidden, experts = dims["top_k"], dims["hidden"], dims["experts"]
    g = gen(300 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    ids = (distinct_ids(1, a, experts, seed=5).repeat(tokens, 1) if same_ids
           else distinct_ids(tokens, a, experts, seed=tokens))
    weights = torch.rand(tokens, a, device="cuda", generator=g)
    sg, su, sd = (p["shared_gate"], p["shared_up"], p["shared_down"]) if shared else (None, None, None)
    q = dict(p, shared_gate=sg, shared_up=su, shared_down=sd)
    if not shared:     # the reference always adds the shared expert: give it zero weights' worth
        q = dict(p, shared_gate=p["shared_gate"], shared_up=p["shared_up"],
                 shared_down=NVFP4Tensor(torch.zeros_like(p["shared_down"].codes), p["shared_down"].block_scales,
                                         p["shared_down"].tensor_scale))
    _, y_ref = expert_reference(x, ids, weights, q)
    h = moe_gate_up(x, ids, p["gate"], p["up"], sg, su)
    two_launches = moe_down(h, ids, weights, p["down"], sd)

    acc = torch.zeros(tokens, hidden, device="cuda", dtype=torch.int64)
    assert moe_split(x, ids, weights, p["gate"], p["up"], p["down"], sg, su, sd, acc=acc) is acc
    y = (acc.double() * 2.0**-32).float()
    assert_close_bf16(y, y_ref, f"moe_split T={tokens}")
    assert_close_bf16(y.bfloat16(), two_launches.float(), f"moe_split against the launches T={tokens}",
                      rtol=2.0**-7, rel_l2=5e-3)
    normed, out = add_rms_norm_fixed(acc, residual, norm_weight, 1e-6)
    assert torch.count_nonzero(acc) == 0, "the norm left the accumulator non-zero"
    assert_close_bf16(out, y_ref + residual.float(), f"moe_split + residual T={tokens}")
    assert torch.equal(normed, rms_norm(out, norm_weight, 1e-6))

    normed_out, out_out = torch.full_like(normed, float("nan")), torch.full_like(out, float("nan"))

    def block():
        moe_split(x, ids, weights, p["gate"], p["up"], p["down"], sg, su, sd, acc=acc, pdl=True)
        add_rms_norm_fixed(acc, residual, norm_weight, 1e-6, out=normed_out, residual_out=out_out, pdl=True)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block()
    for _ in range(3):
        normed_out.fill_(float("nan"))
        out_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.count_nonzero(acc) == 0
        assert torch.equal(out_out, out) and torch.equal(normed_out, normed)


def test_moe_split_refuses_what_it_cannot_take(real_nvfp4_experts):
    p, a = real_nvfp4_experts, REAL["top_k"]
    x = torch.zeros(1, REAL["hidden"], device="cuda", dtype=torch.bfloat16)
    ids, weights = distinct_ids(1, a, REAL["experts"], seed=1), torch.rand(1, a, device="cuda")
    bf16 = make_experts("bf16", 4, 256, 128)
    with pytest.raises(ValueError, match="NVFP4 experts"):
        moe_split(torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16), ids.remainder(4), weights,
                  bf16["gate"], bf16["up"], bf16["down"])
    with pytest.raises(ValueError, match="all three shared"):
        moe_split(x, ids, weights, p["gate"], p["up"], p["down"], p["shared_gate"])
    with pytest.raises(ValueError, match="acc must be torch.int64"):
        moe_split(x, ids, weights, p["gate"], p["up"], p["down"], acc=torch.zeros(1, REAL["hidden"], device="cuda"))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_experts_tiny_all_tokens_same_experts(fmt, tokens):
    """Every token picks the same experts (one owner CTA per expert), no residual."""
    a, hidden, inter = TINY["top_k"], TINY["hidden"], TINY["inter"]
    p = make_experts(fmt, TINY["experts"], hidden, inter, seed=3)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen(5)).bfloat16()
    ids = torch.tensor([[3, 0, 15, 7]], dtype=torch.int32, device="cuda").repeat(tokens, 1)
    weights = torch.rand(tokens, a, device="cuda", generator=gen(6))
    h_ref, y_ref = expert_reference(x, ids, weights, p)
    h = moe_gate_up(x, ids, p["gate"], p["up"], p["shared_gate"], p["shared_up"])
    y = moe_down(h, ids, weights, p["down"], p["shared_down"])
    assert_close_bf16(h, h_ref, f"{fmt} tiny moe_gate_up", rtol=2.0**-7, rel_l2=5e-3)
    assert_close_bf16(y, y_ref, f"{fmt} tiny moe_down")


# ---- end to end against FlintReference.moe ---------------------------------------------------


def tiny_moe_layer(fmt: str, config, layer: int) -> dict:
    prefix = f"model.layers.{layer}.mlp."
    weights = {}
    for spec in tensor_specs(config):
        if not spec.name.startswith(prefix):
            continue
        w = random_tensor(spec, config, seed=0).cuda()
        if spec.fp32:
            weights[spec.name] = w
        elif fmt == "nvfp4" and spec.quantized:
            weights[spec.name] = quantize(w, per_leading_scale=spec.stacked_experts)
        else:
            weights[spec.name] = w.bfloat16()
    return weights


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_matches_flint_reference(fmt, tokens):
    config = dataclasses.replace(preset("flint-tiny"), n_routed_experts=32, num_experts_per_tok=6)
    layer = config.first_k_dense_replace
    weights = tiny_moe_layer(fmt, config, layer)
    reference = FlintReference(config, weights, dtype=torch.float32, device="cuda")
    p = f"model.layers.{layer}.mlp."
    x = torch.randn(tokens, config.hidden_size, device="cuda", generator=gen(tokens)).bfloat16()
    gate, bias = weights[p + "gate.weight"], weights[p + "gate.e_score_correction_bias"]
    ids, _ = route(x, gate, bias, config.num_experts_per_tok, config.routed_scaling_factor)
    ref_ids, _ = reference_route(x.float(), gate.float(), bias, config.num_experts_per_tok,
                                 config.routed_scaling_factor)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in ref_ids.tolist()], \
        "router chose other experts than route(); see test_router_matches_reference"
    y = moe(x, gate, bias, config.num_experts_per_tok, config.routed_scaling_factor,
            weights[p + "experts.gate_proj.weight"], weights[p + "experts.up_proj.weight"],
            weights[p + "experts.down_proj.weight"], weights[p + "shared_experts.gate_proj.weight"],
            weights[p + "shared_experts.up_proj.weight"], weights[p + "shared_experts.down_proj.weight"])
    assert_close_bf16(y, reference.moe(layer, x.float()), f"{fmt} moe vs FlintReference.moe T={tokens}")


def test_moe_in_a_cuda_graph_is_deterministic():
    fmt, t = "nvfp4", 8
    p = make_experts(fmt, REAL["experts"] // 4, REAL["hidden"], REAL["inter"], seed=9)
    e, k = REAL["experts"] // 4, REAL["hidden"]
    x = torch.randn(t, k, device="cuda", generator=gen(1)).bfloat16()
    gate = (torch.randn(e, k, device="cuda", generator=gen(2)) / k**0.5).bfloat16()
    bias = 0.1 * torch.randn(e, device="cuda", generator=gen(3))
    workspace = router_workspace(e, "cuda")

    def step():
        return moe(x, gate, bias, REAL["top_k"], SCALING, p["gate"], p["up"], p["down"], p["shared_gate"],
                   p["shared_up"], p["shared_down"], residual=x, workspace=workspace)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from the eager run"
