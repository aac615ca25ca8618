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
from flint_sched.kernels.grouped_moe import expert_gemms
from flint_sched.model.reference import FlintReference
from flint_sched.model.reference import route as reference_route
from gpu_checks import assert_close_bf16, gen, poisoned
from moe_checks import FLINT, SCALING, SMALL, check_graph_replay, check_moe, dense, make_moe

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 257, 1000, 4099, 8192]


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
    if fmt not in expert_gemm.formats(config):
        pytest.skip(f"{config} is not used for {fmt}")
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


@pytest.mark.parametrize("tokens", [1, 257, 4099])
def test_moe_grouped_tiled_flint_shapes(flint_moe, tokens):
    fmt, p = flint_moe
    check_moe(fmt, p, FLINT, tokens, "tiled flint", gemms="tiled", seed=2000)


@pytest.mark.parametrize("tokens,ntok", [(1000, 1000), (1000, 613), (64, 0)])
def test_moe_grouped_tiled_small_shapes_and_padding(small_moe, tokens, ntok):
    fmt, p = small_moe
    check_moe(fmt, p, SMALL, tokens, "tiled small", ntok=ntok, gemms="tiled", seed=2000)


@pytest.mark.parametrize("tokens", [7, 4099])
def test_moe_grouped_tiled_all_tokens_on_one_expert(small_moe, tokens):
    """A huge bias sends every token to the same 6 experts: items of many tiles of one expert, and
    26 experts with no rows."""
    fmt, p = small_moe
    bias = torch.zeros(SMALL["experts"], device="cuda")
    bias[[3, 5, 8, 13, 21, 31]] = torch.tensor([100.0, 90, 80, 70, 60, 50], device="cuda")
    ws = check_moe(fmt, dict(p, bias=bias), SMALL, tokens, "one expert", gemms="tiled", seed=2000)
    counts = ws.offsets.diff().cpu()
    assert counts[3] == tokens and int((counts[:SMALL["experts"]] == 0).sum()) == SMALL["experts"] - 6


def test_moe_grouped_tiled_cuda_graph_with_pdl(small_moe):
    """Captured with PDL and a device token count; replayed on new inputs it equals eager runs."""
    check_graph_replay(small_moe[1], SMALL, tokens=1500, partial=377, gemms="tiled")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_grouped_matches_flint_reference(fmt):
    """moe_grouped at 4099 tokens (the tiled path by default) against FlintReference.moe, Flint's
    real layer shape. Tokens whose top-6 differs between the kernel's router and route() (fp32
    near-ties) are left out, and there must be few."""
    config = preset("flint")
    layer, tokens = config.first_k_dense_replace, 4099
    assert expert_gemms(tokens, fmt, config.hidden_size, config.moe_intermediate_size) == "tiled"
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
