"""The MoE pieces the grouped-path and tiled-expert-GEMM tests share: weights, an fp32 per-expert
reference loop, and the checks of moe_grouped (`gemms`: force the expert GEMMs; None: its own choice)."""

import torch
import torch.nn.functional as F

from flint_sched.kernels import moe_grouped, moe_routing_workspace
from flint_sched.kernels.grouped import use_cublas
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize
from gpu_checks import assert_close_bf16, gen, poisoned

SCALING = 2.5
FLINT = dict(experts=256, top_k=6, hidden=2048, inter=512)
SMALL = dict(experts=32, top_k=6, hidden=512, inter=256)


def close_moe(out, ref, what):
    """bf16 output of a sum of up to 7 bf16-rounded expert outputs plus the residual: the kernel and
    the reference round h and y to bf16 at the same points but sum in other orders, so a few
    elements land one bf16 ulp apart before the weighted sum (2^-8 relative each); 2^-6 relative
    plus 1 % of the largest magnitude covers a handful of such ulps, far below a wrong row."""
    assert_close_bf16(out, ref, what, rtol=2.0**-6, abs_frac=1e-2, rel_l2=1e-2)


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


def dense(w, e=None, cublas_rows=None):
    """fp32 weight (expert e of a stack): exactly the values the kernels multiply. With
    `cublas_rows` (a call of that many rows with cublas=None): the bf16-rounded values when the
    launcher dequantizes NVFP4 for cuBLAS at that size (grouped.use_cublas)."""
    if isinstance(w, NVFP4Tensor):
        if e is not None:
            w = NVFP4Tensor(w.codes[e], w.block_scales[e], w.tensor_scale[e:e + 1])
        rounded = cublas_rows is not None and use_cublas("nvfp4", cublas_rows, None)
        return w.dequantize(torch.bfloat16 if rounded else torch.float32).float()
    return (w if e is None else w[e]).float()


def moe_reference(x, ids, weights, p, residual, ntok):
    """fp32 per-expert loop; h and each expert's output rounded to bf16 as the kernels store them."""
    xf, out = x.float(), residual.float().clone()
    y = torch.zeros_like(out[:ntok])

    def expert(rows, g, u, d):
        h = (F.silu(xf[rows] @ g.t()) * (xf[rows] @ u.t())).bfloat16().float()
        return (h @ d.t()).bfloat16().float()

    ids = ids[:ntok].long()
    for e in torch.unique(ids).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        y.index_add_(0, rows, expert(rows, dense(p["gate"], e), dense(p["up"], e), dense(p["down"], e))
                     * weights[rows, slot, None])
    all_rows = torch.arange(ntok, device="cuda")
    y += expert(all_rows, dense(p["shared_gate"]), dense(p["shared_up"]), dense(p["shared_down"]))
    out[:ntok] += y
    return out


def run_moe(p, x, residual, ws, top_k, num_tokens=None, pdl=False, gemms=None):
    out = poisoned(*x.shape)
    moe_grouped(x, p["router"], p["bias"], top_k, SCALING, p["gate"], p["up"], p["down"], p["shared_gate"],
                p["shared_up"], p["shared_down"], residual, ws, out=out, num_tokens=num_tokens, pdl=pdl,
                gemms=gemms)
    return out


def check_moe(fmt, p, shape, tokens, what, ntok=None, gemms=None, seed=1000):
    """moe_grouped of `tokens` rows (the first `ntok` real) against moe_reference; padded rows keep
    the residual and a second run is bit-identical. Returns the workspace."""
    ntok = tokens if ntok is None else ntok
    g = gen(seed + tokens)
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, shape["hidden"], device="cuda", generator=g).bfloat16()
    ws = moe_routing_workspace(tokens, shape["experts"], shape["top_k"], "cuda", hidden_size=shape["hidden"],
                               intermediate_size=shape["inter"])
    num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
    out = run_moe(p, x, residual, ws, shape["top_k"], num_tokens, gemms=gemms)
    ref = moe_reference(x, ws.ids[:tokens], ws.weights[:tokens], p, residual, ntok)
    close_moe(out, ref, f"{fmt} {what} T={tokens} real={ntok}")
    assert torch.equal(out[ntok:], residual[ntok:]), "padded rows differ from the residual"
    again = run_moe(p, x, residual, ws, shape["top_k"], num_tokens, gemms=gemms)
    assert torch.equal(out, again), "two runs differ"
    return ws


def check_graph_replay(p, shape, tokens, partial, gemms=None):
    """moe_grouped captured with PDL and a device token count; replayed on new inputs (all tokens,
    then `partial` real ones) it equals eager runs."""
    ws = moe_routing_workspace(tokens, shape["experts"], shape["top_k"], "cuda", hidden_size=shape["hidden"],
                               intermediate_size=shape["inter"])
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=gen(7)).bfloat16()
    residual = torch.randn_like(x)
    num_tokens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = poisoned(tokens, shape["hidden"])

    def step():
        moe_grouped(x, p["router"], p["bias"], shape["top_k"], SCALING, p["gate"], p["up"], p["down"],
                    p["shared_gate"], p["shared_up"], p["shared_down"], residual, ws, out=out,
                    num_tokens=num_tokens, pdl=True, gemms=gemms)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, ntok in ((8, tokens), (9, partial), (10, tokens)):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen(seed)).bfloat16())
        num_tokens.fill_(ntok)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = run_moe(p, x, residual, ws, shape["top_k"], num_tokens, gemms=gemms)
        assert torch.equal(out, eager), f"graph replay (seed {seed}, {ntok} tokens) differs from eager"
