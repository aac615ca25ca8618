"""Tiled expert GEMMs (cuda/expert_gemm.cu) against plain torch, and moe_grouped on that path.

The GEMMs are checked row by row in the sorted layout against an fp32 per-expert loop over the
same bf16 inputs and dequantized weights (down from the kernel's own bf16 h, so each GEMM is
judged alone); moe_grouped end to end against the per-expert loop of test_kernel_grouped.py's
kind and against model/reference.py's MoE. Outputs start as NaN: an element the kernels skip fails.
"""

import pytest
import torch
import torch.nn.functional as F

from flint_sched.config import preset
from flint_sched.kernels import expert_gemm, moe_grouped, moe_routing_workspace, route_and_sort
from flint_sched.kernels.grouped_moe import use_expert_gemm
from flint_sched.model.reference import FlintReference
from flint_sched.model.reference import route as reference_route
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize
from gpu_checks import assert_close_bf16, gen, poisoned

pytestmark = pytest.mark.gpu

SCALING = 2.5
FLINT = dict(experts=256, top_k=6, hidden=2048, inter=512)
SMALL = dict(experts=32, top_k=6, hidden=512, inter=256)
TOKENS = [1, 7, 257, 1000, 4099, 8192]


def make_weight(fmt, *shape, g):
    w = torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5
    return w.bfloat16() if fmt == "bf16" else quantize(w, per_leading_scale=len(shape) == 3)


def make_moe(fmt, shape, seed=0):
    g = gen(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    return dict(router=(torch.randn(e, h, device="cuda", generator=g) / h**0.5).bfloat16(),
                bias=0.1 * torch.randn(e, device="cuda", generator=g),
                gate=make_weight(fmt, e, i, h, g=g), up=make_weight(fmt, e, i, h, g=g),
                down=make_weight(fmt, e, h, i, g=g), shared_gate=make_weight(fmt, i, h, g=g),
                shared_up=make_weight(fmt, i, h, g=g), shared_down=make_weight(fmt, h, i, g=g))


def dense(w, e=None):
    """fp32 weight (expert e of a stack): exactly the values the kernels multiply."""
    if isinstance(w, NVFP4Tensor):
        if e is not None:
            w = NVFP4Tensor(w.codes[e], w.block_scales[e], w.tensor_scale[e:e + 1])
        return w.dequantize(torch.float32)
    return (w if e is None else w[e]).float()


def expert_weights(p, e, experts):
    if e == experts:
        return dense(p["shared_gate"]), dense(p["shared_up"]), dense(p["shared_down"])
    return dense(p["gate"], e), dense(p["up"], e), dense(p["down"], e)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def flint_moe(request):
    return request.param, make_moe(request.param, FLINT, seed=11)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def small_moe(request):
    return request.param, make_moe(request.param, SMALL, seed=12)


# ---- the two GEMMs alone, in the sorted layout ----------------------------------------------------


@pytest.mark.parametrize("config", sorted(expert_gemm.CONFIGS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_expert_gemms_match_per_expert_loop(flint_moe, tokens, config):
    fmt, p = flint_moe
    shape = FLINT
    e, hidden, inter, top_k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    g = gen(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    logits = 2 * torch.randn(tokens, e, device="cuda", generator=g)
    ws = moe_routing_workspace(tokens, e, top_k, "cuda")
    r = route_and_sort(logits, p["bias"], top_k, SCALING, ws, chunk=expert_gemm.TILE_M)
    pairs = tokens * (top_k + 1)
    h = expert_gemm.expert_gate_up(x, r, p["gate"], p["up"], p["shared_gate"], p["shared_up"],
                                   out=poisoned(pairs, inter), config=config)
    y = expert_gemm.expert_down(h, r, p["down"], p["shared_down"], out=poisoned(pairs, hidden), config=config)
    offsets, st = r.offsets.cpu().tolist(), r.sorted_token.long()
    h_ref, y_ref = torch.empty(pairs, inter, device="cuda"), torch.empty(pairs, hidden, device="cuda")
    for ex in range(e + 1):
        lo, hi = offsets[ex], offsets[ex + 1]
        if lo == hi:
            continue
        wg, wu, wd = expert_weights(p, ex, e)
        xr = x[st[lo:hi]].float()
        h_ref[lo:hi] = F.silu(xr @ wg.t()) * (xr @ wu.t())
        y_ref[lo:hi] = h[lo:hi].float() @ wd.t()
    assert_close_bf16(h, h_ref, f"{fmt} {config} gate/up T={tokens}")
    assert_close_bf16(y, y_ref, f"{fmt} {config} down T={tokens}")


# ---- moe_grouped on the tiled path ---------------------------------------------------------------


def moe_reference(x, ids, weights, p, residual, ntok):
    """fp32 per-expert loop; h and each expert's output rounded to bf16 as the kernels store them."""
    xf, out = x.float(), residual.float().clone()
    y = torch.zeros_like(out[:ntok])

    def expert(rows, wg, wu, wd):
        h = (F.silu(xf[rows] @ wg.t()) * (xf[rows] @ wu.t())).bfloat16().float()
        return (h @ wd.t()).bfloat16().float()

    ids = ids[:ntok].long()
    for e in torch.unique(ids).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        y.index_add_(0, rows, expert(rows, dense(p["gate"], e), dense(p["up"], e), dense(p["down"], e))
                     * weights[rows, slot, None])
    all_rows = torch.arange(ntok, device="cuda")
    y += expert(all_rows, dense(p["shared_gate"]), dense(p["shared_up"]), dense(p["shared_down"]))
    out[:ntok] += y
    return out


def run_moe(p, x, residual, ws, top_k, num_tokens=None, pdl=False):
    out = poisoned(*x.shape)
    moe_grouped(x, p["router"], p["bias"], top_k, SCALING, p["gate"], p["up"], p["down"], p["shared_gate"],
                p["shared_up"], p["shared_down"], residual, ws, out=out, num_tokens=num_tokens, pdl=pdl,
                tiled=True)
    return out


def check_moe(fmt, p, shape, tokens, what, ntok=None):
    """As test_kernel_grouped.check_moe (its tolerances: a few bf16 ulps of h and y apart)."""
    ntok = tokens if ntok is None else ntok
    g = gen(2000 + tokens)
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, shape["hidden"], device="cuda", generator=g).bfloat16()
    ws = moe_routing_workspace(tokens, shape["experts"], shape["top_k"], "cuda", hidden_size=shape["hidden"],
                               intermediate_size=shape["inter"])
    num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
    out = run_moe(p, x, residual, ws, shape["top_k"], num_tokens)
    ref = moe_reference(x, ws.ids[:tokens], ws.weights[:tokens], p, residual, ntok)
    assert_close_bf16(out, ref, f"{fmt} {what} T={tokens} real={ntok}", rtol=2.0**-6, abs_frac=1e-2, rel_l2=1e-2)
    assert torch.equal(out[ntok:], residual[ntok:]), "padded rows differ from the residual"
    again = run_moe(p, x, residual, ws, shape["top_k"], num_tokens)
    assert torch.equal(out, again), "two runs differ"
    return ws


@pytest.mark.parametrize("tokens", [1, 257, 4099])
def test_moe_grouped_tiled_flint_shapes(flint_moe, tokens):
    fmt, p = flint_moe
    check_moe(fmt, p, FLINT, tokens, "tiled flint")


@pytest.mark.parametrize("tokens,ntok", [(1000, 1000), (1000, 613), (64, 0)])
def test_moe_grouped_tiled_small_shapes_and_padding(small_moe, tokens, ntok):
    fmt, p = small_moe
    check_moe(fmt, p, SMALL, tokens, "tiled small", ntok=ntok)


@pytest.mark.parametrize("tokens", [7, 4099])
def test_moe_grouped_tiled_all_tokens_on_one_expert(small_moe, tokens):
    """A huge bias sends every token to the same 6 experts: items of many tiles of one expert, and
    26 experts with no rows."""
    fmt, p = small_moe
    bias = torch.zeros(SMALL["experts"], device="cuda")
    bias[[3, 5, 8, 13, 21, 31]] = torch.tensor([100.0, 90, 80, 70, 60, 50], device="cuda")
    ws = check_moe(fmt, dict(p, bias=bias), SMALL, tokens, "one expert")
    counts = ws.offsets.diff().cpu()
    assert counts[3] == tokens and int((counts[:SMALL["experts"]] == 0).sum()) == SMALL["experts"] - 6


def test_moe_grouped_tiled_cuda_graph_with_pdl(small_moe):
    """Captured with PDL and a device token count; replayed on new inputs it equals eager runs."""
    fmt, p = small_moe
    tokens, shape = 1500, SMALL
    ws = moe_routing_workspace(tokens, shape["experts"], shape["top_k"], "cuda", hidden_size=shape["hidden"],
                               intermediate_size=shape["inter"])
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=gen(7)).bfloat16()
    residual = torch.randn_like(x)
    num_tokens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = poisoned(tokens, shape["hidden"])

    def step():
        moe_grouped(x, p["router"], p["bias"], shape["top_k"], SCALING, p["gate"], p["up"], p["down"],
                    p["shared_gate"], p["shared_up"], p["shared_down"], residual, ws, out=out,
                    num_tokens=num_tokens, pdl=True, tiled=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, ntok in ((8, tokens), (9, 377), (10, tokens)):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen(seed)).bfloat16())
        num_tokens.fill_(ntok)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = run_moe(p, x, residual, ws, shape["top_k"], num_tokens)
        assert torch.equal(out, eager), f"graph replay (seed {seed}, {ntok} tokens) differs from eager"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_grouped_matches_flint_reference(fmt):
    """moe_grouped at 4099 tokens (the tiled path by default) against FlintReference.moe, Flint's
    real layer shape. Tokens whose top-6 differs between the kernel's router and route() (fp32
    near-ties) are left out, and there must be few."""
    config = preset("flint")
    layer, tokens = config.first_k_dense_replace, 4099
    assert use_expert_gemm(tokens, fmt, config.hidden_size, config.moe_intermediate_size)
    p = make_moe(fmt, FLINT, seed=21)
    pre = f"model.layers.{layer}.mlp."
    weights = {pre + "gate.weight": p["router"], pre + "gate.e_score_correction_bias": p["bias"],
               pre + "experts.gate_proj.weight": p["gate"], pre + "experts.up_proj.weight": p["up"],
               pre + "experts.down_proj.weight": p["down"], pre + "shared_experts.gate_proj.weight": p["shared_gate"],
               pre + "shared_experts.up_proj.weight": p["shared_up"],
               pre + "shared_experts.down_proj.weight": p["shared_down"]}
    reference = FlintReference(config, weights, dtype=torch.float32, device="cuda")
    x = torch.randn(tokens, config.hidden_size, device="cuda", generator=gen(5)).bfloat16()
    zero = torch.zeros_like(x)
    ws = moe_routing_workspace(tokens, FLINT["experts"], FLINT["top_k"], "cuda", hidden_size=FLINT["hidden"],
                               intermediate_size=FLINT["inter"])
    out = poisoned(tokens, config.hidden_size)
    moe_grouped(x, p["router"], p["bias"], FLINT["top_k"], config.routed_scaling_factor, p["gate"], p["up"],
                p["down"], p["shared_gate"], p["shared_up"], p["shared_down"], zero, ws, out=out)
    ref_ids, _ = reference_route(x.float(), p["router"].float(), p["bias"], FLINT["top_k"],
                                 config.routed_scaling_factor)
    same = (ws.ids.sort(dim=1).values == ref_ids.int().sort(dim=1).values).all(dim=1)
    assert int((~same).sum()) <= tokens // 200, f"{int((~same).sum())} tokens routed differently"
    ref = reference.moe(layer, x.float())
    assert_close_bf16(out[same], ref[same], f"{fmt} moe_grouped vs FlintReference.moe T={tokens}",
                      rtol=2.0**-6, abs_frac=1e-2, rel_l2=1e-2)
