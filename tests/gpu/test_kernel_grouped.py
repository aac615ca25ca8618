"""Grouped path (cuda/grouped_gemm.cu, the MoE block over cuda/moe_routing.cu) against plain torch,
any token count.

Expert GEMMs are checked against an fp32 per-expert loop from the same bf16 inputs, dequantized
weights and the kernel's own ids/weights (router near-ties cannot blur a GEMM failure); the
routing is checked on its own (test_kernel_routing.py). Outputs start as NaN, so an element the
kernels skip fails.
"""

import pytest
import torch
import torch.nn.functional as F

from flint_sched.kernels import (expert_decode, grouped, grouped_gate_up, grouped_linear, grouped_moe, moe_grouped,
                                 moe_routing_workspace, route_and_sort)
from flint_sched.kernels.dequant import dequantize_bf16
from flint_sched.kernels.linear import concat_rows
from flint_sched.kernels.norm import rms_norm
from gpu_checks import assert_close_bf16, gen, poisoned
from moe_checks import FLINT, SCALING, SMALL, check_graph_replay, check_moe, dense, make_moe, make_weight, run_moe

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 9, 63, 257, 4099]


# ---- the whole MoE block ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def flint_moe(request):
    return request.param, make_moe(request.param, FLINT, seed=1)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def small_moe(request):
    return request.param, make_moe(request.param, SMALL, seed=2)


@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_grouped_flint_shapes(flint_moe, tokens):
    fmt, p = flint_moe
    check_moe(fmt, p, FLINT, tokens, "flint")


@pytest.mark.parametrize("tokens", [9, 64, 256])
def test_moe_grouped_with_8_row_items(flint_moe, tokens, monkeypatch):
    """grouped.MOE_SMALL_CHUNK = 8 (one row group per item; experts with more rows split)."""
    monkeypatch.setattr(grouped, "MOE_SMALL_CHUNK", 8)
    fmt, p = flint_moe
    check_moe(fmt, p, FLINT, tokens, "flint, 8-row items")


@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_grouped_small_shapes(small_moe, tokens):
    fmt, p = small_moe
    check_moe(fmt, p, SMALL, tokens, "small")


@pytest.mark.parametrize("tokens", [9, 257, 4099])
def test_moe_grouped_all_tokens_on_one_expert(small_moe, tokens):
    """A huge bias puts every token on expert 3 (many items of one expert); the 6 biased experts
    take everything, so 26 experts get no token."""
    fmt, p = small_moe
    bias = torch.zeros(SMALL["experts"], device="cuda")
    bias[[3, 5, 8, 13, 21, 31]] = torch.tensor([100.0, 90, 80, 70, 60, 50], device="cuda")
    ws = check_moe(fmt, dict(p, bias=bias), SMALL, tokens, "one expert")
    counts = ws.offsets.diff().cpu()
    assert counts[3] == tokens and int((counts[:SMALL["experts"]] == 0).sum()) == SMALL["experts"] - 6


@pytest.mark.parametrize("tokens,ntok", [(16, 9), (64, 1), (257, 200), (8, 0)])
def test_moe_grouped_padded_tokens(flint_moe, tokens, ntok):
    fmt, p = flint_moe
    ws = check_moe(fmt, p, FLINT, tokens, "padded", ntok=ntok)
    assert int(ws.offsets[-1]) == ntok * (FLINT["top_k"] + 1), "padded tokens reached an expert"


@pytest.fixture(scope="module")
def flint_nvfp4_moe():
    return make_moe("nvfp4", FLINT, seed=3)


@pytest.mark.parametrize("gemms", ["decode", "swap-ab"])
@pytest.mark.parametrize("tokens,ntok", [(1, 1), (16, 16), (64, 50), (256, 256), (600, 600)])
def test_moe_grouped_nvfp4_decode_and_swap_ab_gemms(flint_nvfp4_moe, gemms, tokens, ntok):
    """Both NVFP4 GEMMs for few rows per expert at Flint's shapes, forced (the decode ones are the
    default below the tiled GEMMs' 512 tokens; 600 tokens: 14 rows per expert on average, so most
    experts take two 8-row items, and the shared expert 75)."""
    assert grouped_moe.expert_gemms(tokens, "nvfp4", FLINT["hidden"], FLINT["inter"], gemms) == gemms
    check_moe("nvfp4", flint_nvfp4_moe, FLINT, tokens, gemms, ntok=ntok, gemms=gemms)


@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("tokens", [100, 600])
@pytest.mark.parametrize("config", sorted(expert_decode.CONFIGS))
def test_every_decode_gemm_config(flint_nvfp4_moe, config, tokens, launches, monkeypatch):
    """Each compile-time config of the decode GEMMs (the ones benchmarks compare), in two launches and
    in one, against the per-expert loop: at 100 tokens most experts hold 1-4 rows, at 600 about 14
    (16-row configs: items of 9-16 rows run both groups, the shared expert's too, an expert's last item
    often one)."""
    monkeypatch.setattr(expert_decode, "CONFIG", config)
    monkeypatch.setattr(grouped_moe, "FUSED_DECODE_CONFIGS", {config} if launches == 1 else set())
    check_moe("nvfp4", flint_nvfp4_moe, FLINT, tokens, f"decode {config}, {launches} launches", gemms="decode")


@pytest.mark.parametrize("gemms,tokens", [("decode", 100), ("decode", 256), ("tiled", 600), (None, 40)])
def test_moe_grouped_work_list_in_expert_order(flint_moe, gemms, tokens, monkeypatch):
    """The work list in expert order (grouped_moe.HEAVY_FIRST off; on by default) gives the same
    result through every expert GEMM."""
    monkeypatch.setattr(grouped_moe, "HEAVY_FIRST", False)
    fmt, p = flint_moe
    check_moe(fmt, p, FLINT, tokens, f"expert order, {gemms}", gemms=gemms)


@pytest.mark.parametrize("tokens", [1, 16, 100, 256, 600])
@pytest.mark.parametrize("config", ["g1t2", "g1t4d8", "g2w8t4", "g1t2p", "g1t4d8p", "g2w8t4p", "g1t2d8", "g1t2d4",
                                    "g1t2d4c"])
def test_decode_gemms_in_one_launch(flint_nvfp4_moe, config, tokens, monkeypatch):
    """expert_decode_moe (gate/up and down in one launch, down units waiting on their item's
    gate/up units: by the queue's counters, or at the barrier of the item's cluster) equals the
    per-expert loop, then replays from a graph with PDL."""
    monkeypatch.setattr(grouped_moe, "FUSED_DECODE_CONFIGS", {config})
    monkeypatch.setattr(expert_decode, "CONFIG", config)
    ws = check_moe("nvfp4", flint_nvfp4_moe, FLINT, tokens, f"one launch, {config}", gemms="decode")
    per_item = {"g1t2": 8 + 16, "g1t4d8": 4 + 4, "g2w8t4": 2 + 4, "g1t2d8": 8 + 4, "g1t2d4": 8 + 8}
    if not config.endswith("c"):    # the cluster kernel takes no unit from the queue
        units = int(ws.num_work) * per_item[config.removesuffix("p")]
        assert int(ws.queue[0]) == units, "not every unit taken once"
    if tokens == 100:
        check_graph_replay(flint_nvfp4_moe, FLINT, tokens=100, partial=37, gemms="decode")


@pytest.mark.parametrize("tokens,ntok", [(1, 1), (7, 7), (9, 9), (16, 16), (16, 9), (12, 0), (32, 30)])
def test_routing_inside_the_cluster_kernel(flint_nvfp4_moe, tokens, ntok, monkeypatch):
    """expert_decode_moe_routed (each cluster routes from the logits itself): against the per-expert
    loop, and bit for bit what moe_route + the cluster kernel give: output, ids, weights, offsets,
    sorted rows, pair rows (-1 for padded tokens) and the same items (here in expert order)."""
    monkeypatch.setattr(expert_decode, "CONFIG", "g1t2d4c")
    monkeypatch.setattr(grouped_moe, "CLUSTER_ROUTE_MAX_TOKENS", 32)
    p, g, top_k = flint_nvfp4_moe, gen(2000 + tokens), FLINT["top_k"]
    check_moe("nvfp4", p, FLINT, tokens, "routed in the cluster kernel", ntok=ntok, gemms="decode")
    x = torch.randn(tokens, FLINT["hidden"], device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, FLINT["hidden"], device="cuda", generator=g).bfloat16()
    num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")

    def run(max_tokens):
        monkeypatch.setattr(grouped_moe, "CLUSTER_ROUTE_MAX_TOKENS", max_tokens)
        ws = moe_routing_workspace(tokens, FLINT["experts"], top_k, "cuda", hidden_size=FLINT["hidden"],
                                   intermediate_size=FLINT["inter"])
        ws.pair_row.fill_(-7)
        return ws, run_moe(p, x, residual, ws, top_k, num_tokens, gemms="decode")

    (routed, out), (plain, expected) = run(32), run(0)
    assert torch.equal(out, expected)
    rows = ntok * (top_k + 1)
    for name in ("ids", "weights"):
        assert torch.equal(getattr(routed, name)[:ntok], getattr(plain, name)[:ntok]), name
    assert torch.equal(routed.offsets, plain.offsets) and torch.equal(routed.pair_row, plain.pair_row)
    assert torch.equal(routed.sorted_token[:rows], plain.sorted_token[:rows])
    items = int(plain.num_work)
    assert int(routed.num_work) == items

    def work(ws):
        return sorted(zip(ws.work_expert[:items].tolist(), ws.work_row[:items].tolist()))
    assert work(routed) == work(plain)
    assert routed.work_expert[:items].tolist() == sorted(routed.work_expert[:items].tolist()), "not in expert order"
    if tokens == 16:
        monkeypatch.setattr(grouped_moe, "CLUSTER_ROUTE_MAX_TOKENS", 32)
        check_graph_replay(p, FLINT, tokens=16, partial=ntok, gemms="decode")


def test_moe_grouped_decode_gemms_one_expert_and_graph(flint_nvfp4_moe):
    """The decode GEMMs with every token on one expert (40 items of 8 rows of one expert's weights,
    and of the shared expert's), then captured in a graph with PDL and replayed with fewer tokens."""
    bias = torch.zeros(FLINT["experts"], device="cuda")
    bias[[7, 9, 11, 100, 200, 255]] = torch.tensor([100.0, 90, 80, 70, 60, 50], device="cuda")
    ws = check_moe("nvfp4", dict(flint_nvfp4_moe, bias=bias), FLINT, 317, "decode, one expert", gemms="decode")
    assert ws.offsets.diff()[7] == 317
    check_graph_replay(flint_nvfp4_moe, FLINT, tokens=200, partial=77, gemms="decode")


@pytest.mark.parametrize("config", ["g2w8t4", "g2w8t4p"])
def test_decode_gemms_of_16_row_items_with_one_expert(flint_nvfp4_moe, config, monkeypatch):
    """A 16-row config with every token on one expert: 20 items of 16 rows and a last one of 13 (in
    one launch with down units of two items: 10 pairs and the last item alone)."""
    monkeypatch.setattr(expert_decode, "CONFIG", config)
    monkeypatch.setattr(grouped_moe, "FUSED_DECODE_CONFIGS", {config})
    bias = torch.zeros(FLINT["experts"], device="cuda")
    bias[[7, 9, 11, 100, 200, 255]] = torch.tensor([100.0, 90, 80, 70, 60, 50], device="cuda")
    ws = check_moe("nvfp4", dict(flint_nvfp4_moe, bias=bias), FLINT, 333, f"decode {config}, one expert",
                   gemms="decode")
    assert ws.offsets.diff()[7] == 333 and ws.num_work.item() == 6 * 21 + 21


@pytest.mark.parametrize("split", [8, 32, 200])
@pytest.mark.parametrize("tokens,ntok", [(16, 16), (100, 93), (256, 256), (600, 517), (4099, 4099)])
def test_moe_grouped_hybrid_gemms(flint_nvfp4_moe, tokens, ntok, split, monkeypatch):
    """The hybrid expert GEMMs (tiled for experts of more than `split` rows, decode for the rest,
    writing their own rows of the same buffers) against the per-expert loop, five experts made heavy
    by the bias; then from a graph with PDL."""
    monkeypatch.setattr(grouped_moe, "HYBRID_SPLIT_ROWS", split)
    bias = torch.zeros(FLINT["experts"], device="cuda")
    bias[[3, 50, 51, 200, 255]] = 0.5
    p = dict(flint_nvfp4_moe, bias=bias)
    ws = check_moe("nvfp4", p, FLINT, tokens, f"hybrid, split {split}", ntok=ntok, gemms="hybrid")
    assert int(ws.num_work) + int(ws.num_work2) > 0
    if tokens == 256:
        check_graph_replay(p, FLINT, tokens=256, partial=77, gemms="hybrid")


@pytest.mark.parametrize("gemms", ["decode", "tiled", "hybrid"])
@pytest.mark.parametrize("tokens,ntok", [(16, 9), (64, 64), (600, 517)])
def test_moe_grouped_with_the_next_norm(flint_nvfp4_moe, gemms, tokens, ntok):
    """moe_finalize_norm: the MoE output bit for bit the plain finalize's, and its RMSNorm bit for
    bit the rmsnorm kernel's over that output (padded rows: the residual and its norm)."""
    p, g = flint_nvfp4_moe, gen(tokens)
    x = torch.randn(tokens, FLINT["hidden"], device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, FLINT["hidden"], device="cuda", generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(FLINT["hidden"], device="cuda", generator=g)).bfloat16()
    ws = moe_routing_workspace(tokens, FLINT["experts"], FLINT["top_k"], "cuda", hidden_size=FLINT["hidden"],
                               intermediate_size=FLINT["inter"])
    num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
    plain = run_moe(p, x, residual, ws, FLINT["top_k"], num_tokens, gemms=gemms)
    out, normed = poisoned(tokens, FLINT["hidden"]), poisoned(tokens, FLINT["hidden"])
    moe_grouped(x, p["router"], p["bias"], FLINT["top_k"], SCALING, p["gate"], p["up"], p["down"], p["shared_gate"],
                p["shared_up"], p["shared_down"], residual, ws, out=out, num_tokens=num_tokens, pdl=True,
                gemms=gemms, norm_weight=weight, norm_out=normed, norm_eps=1e-5)
    assert torch.equal(out, plain)
    assert torch.equal(normed, rms_norm(plain, weight, 1e-5))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [9, 16, 17, 128, 129, 300])
def test_grouped_linear_with_the_next_norm(fmt, m):
    """grouped_linear with a residual and the RMSNorm after it (cuBLAS's epilogue kernel, or our
    kernel then the norm): y bit for bit as without the norm (up to grouped.NORM_SPLIT_MAX_ROWS rows
    cuBLAS's split-K parts, added in the same order either way), norm_out the rmsnorm kernel's over y."""
    g = gen(m + 5)
    w = make_weight(fmt, 2048, 4096, g=g)
    x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
    residual = torch.randn(m, 2048, device="cuda", generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(2048, device="cuda", generator=g)).bfloat16()
    plain = grouped_linear(x, w, residual=residual)
    normed = poisoned(m, 2048)
    y = grouped_linear(x, w, residual=residual, out=poisoned(m, 2048), norm_weight=weight, norm_out=normed,
                       norm_eps=1e-5, pdl=True)
    assert torch.equal(y, plain) and torch.equal(normed, rms_norm(plain, weight, 1e-5))
    assert_close_bf16(y, x.float() @ dense(w, cublas_rows=m).t() + residual.float(), f"{fmt} y, M={m}")
    with pytest.raises(ValueError, match="norm_out"):
        grouped_linear(x, w, residual=residual, norm_weight=weight)


@pytest.mark.parametrize("tokens,partial,router_gemv", [(12, 5, 16), (12, 5, 0), (100, 37, 16)])
def test_moe_grouped_cuda_graph_with_pdl(small_moe, tokens, partial, router_gemv, monkeypatch):
    """Captured with PDL and a device token count; replayed on new inputs it equals eager runs
    (the router's logits on the GEMV up to router_gemv tokens)."""
    monkeypatch.setattr(grouped_moe, "ROUTER_GEMV_MAX_ROWS", router_gemv)
    check_graph_replay(small_moe[1], SMALL, tokens=tokens, partial=partial)


# ---- dense -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,cublas", [("bf16", False), ("bf16", None), ("nvfp4", False), ("nvfp4", None)])
@pytest.mark.parametrize("n,k", [(200, 512), (2056, 2048), (256, 2048)])
@pytest.mark.parametrize("m", [1, 9, 100, 256, 1000])
def test_grouped_linear(m, n, k, fmt, cublas):
    """Our kernel (cublas=False), or what the launcher picks (cuBLAS for BF16, and for NVFP4 from 17
    rows on after dequantizing)."""
    g = gen(m * 7 + n)
    w = make_weight(fmt, n, k, g=g)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    residual = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    ref = x.float() @ dense(w, cublas_rows=m if cublas is None else None).t()
    y = grouped_linear(x, w, out=poisoned(m, n), cublas=cublas)
    assert_close_bf16(y, ref, f"{fmt} grouped_linear M={m} N={n}")
    y = grouped_linear(x, w, residual=residual, out=poisoned(m, n), cublas=cublas)
    assert_close_bf16(y, ref + residual.float(), f"{fmt} grouped_linear+residual M={m} N={n}")
    y32 = grouped_linear(x, w, out=poisoned(m, n, dtype=torch.float32), out_dtype=torch.float32, cublas=cublas)
    # fp32 out: only the summation order differs from the exact reference (over the bf16-rounded
    # weights where the launcher dequantizes NVFP4 for cuBLAS).
    ref = x.float() @ dense(w, cublas_rows=m if cublas is None else None).t()
    torch.testing.assert_close(y32, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    again = grouped_linear(x, w, out_dtype=torch.float32, cublas=cublas)
    assert torch.equal(y32, again), "two runs differ"


@pytest.mark.parametrize("m", [1, 9, 100, 300])
def test_grouped_linear_row_splits_keep_each_parts_scale(m):
    """q/k/v stacked by rows (concat_rows), NVFP4: each part's rows use its own tensor scale."""
    g = gen(m + 11)
    parts = [make_weight("nvfp4", n, 512, g=g) for n in (256, 64, 64)]
    for scale, part in zip((1.0, 3.0, 0.25), parts):
        part.tensor_scale.mul_(scale)
    fused, splits = concat_rows(parts)
    x = torch.randn(m, 512, device="cuda", generator=g).bfloat16()
    for cublas in (False, None):
        ref = torch.cat([x.float() @ dense(p, cublas_rows=m if cublas is None else None).t() for p in parts], dim=1)
        y = grouped_linear(x, fused, out=poisoned(m, 384), row_splits=splits, cublas=cublas)
        assert_close_bf16(y, ref, f"q/k/v rows M={m} cublas={cublas}")
    assert torch.equal(dequantize_bf16(fused, row_splits=splits),
                       torch.cat([p.dequantize(torch.bfloat16) for p in parts])), "dequantized q/k/v rows differ"


@pytest.mark.parametrize("n,k", [(1, 64), (7, 128), (384, 2048), (10240, 2048)])
def test_dequantize_bf16_is_bit_exact(n, k):
    w = make_weight("nvfp4", n, k, g=gen(n + k))
    out = poisoned(n, k)
    assert torch.equal(dequantize_bf16(w, out=out), w.dequantize(torch.bfloat16))


@pytest.mark.parametrize("cublas", [False, None])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 9, 100, 1000])
def test_grouped_gate_up(m, fmt, cublas):
    g = gen(m + 3)
    i, k = 264, 512
    gate, up = make_weight(fmt, i, k, g=g), make_weight(fmt, i, k, g=g)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    rows = m if cublas is None else None
    ref = F.silu(x.float() @ dense(gate, cublas_rows=rows).t()) * (x.float() @ dense(up, cublas_rows=rows).t())
    h = grouped_gate_up(x, gate, up, out=poisoned(m, i), cublas=cublas)
    assert_close_bf16(h, ref, f"{fmt} grouped_gate_up M={m}")


def test_grouped_linear_in_a_cuda_graph():
    m, n, k = 33, 520, 2048
    w = make_weight("nvfp4", n, k, g=gen(1))
    x = torch.randn(m, k, device="cuda", generator=gen(2)).bfloat16()
    out = poisoned(m, n)
    grouped_linear(x, w, out=out, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_linear(x, w, out=out, pdl=True)
    x.copy_(torch.randn(m, k, device="cuda", generator=gen(3)).bfloat16())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, grouped_linear(x, w)), "graph replay differs from eager"


def test_clear_errors():
    x = torch.randn(4, 100, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="K % 8"):
        grouped_linear(x, torch.randn(16, 100, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="bf16 or fp32"):
        grouped_linear(x[:, :96].contiguous(), torch.randn(16, 96, device="cuda").bfloat16(), out_dtype=torch.float16)
    ws = moe_routing_workspace(4, 32, 6, "cuda")
    with pytest.raises(ValueError, match="do not fit"):
        route_and_sort(torch.randn(5, 32, device="cuda"), torch.zeros(32, device="cuda"), 6, SCALING, ws)


@pytest.mark.parametrize("config,tokens", [("g1t2d4", 16), ("g2w8t4p", 256)])
def test_decode_moe_trace_build(flint_nvfp4_moe, config, tokens):
    """expert_decode_moe's ED_TRACE build (benchmarks/decode_moe_trace.py): the same y_sorted bit for
    bit as the untraced build, every unit taken once, and each CTA's phase times in order."""
    p = flint_nvfp4_moe
    x = torch.randn(tokens, FLINT["hidden"], device="cuda", generator=gen(5)).bfloat16()
    ws = moe_routing_workspace(tokens, FLINT["experts"], FLINT["top_k"], "cuda", hidden_size=FLINT["hidden"],
                               intermediate_size=FLINT["inter"])
    logits = torch.mm(x, p["router"].t(), out_dtype=torch.float32)
    pairs = tokens * (FLINT["top_k"] + 1)
    ys = []
    for traced in (False, True):
        routing = route_and_sort(logits, p["bias"], FLINT["top_k"], SCALING, ws,
                                 chunk=expert_decode.rows_per_item(config))
        ctas = expert_decode.moe_grid_ctas(routing.max_items, config, FLINT["hidden"], FLINT["inter"])
        trace = torch.zeros(ctas, expert_decode.TRACE_SLOTS, dtype=torch.int64, device="cuda") if traced else None
        y = expert_decode.expert_decode_moe(x, routing, ws.queue, p["gate"], p["up"], p["shared_gate"], p["shared_up"],
                                            p["down"], p["shared_down"], ws.h_sorted[:pairs],
                                            out=ws.y_sorted[:pairs].clone(), config=config, trace=trace)
        ys.append(y[:int(ws.offsets[-1])].clone())
    assert torch.equal(ys[0], ys[1])
    items = int(routing.work_args[3].item())
    units = items * sum(expert_decode.moe_units(config, FLINT["hidden"], FLINT["inter"]))
    t = trace.cpu()
    took = t[:, 1] > 0
    assert sorted(t[took, 7].tolist()) == list(range(units))
    done = took & (t[:, 5] > 0)
    assert int(done.sum()) >= items * expert_decode.moe_units(config, FLINT["hidden"], FLINT["inter"])[0]
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]:
        assert bool((t[done, a] <= t[done, b]).all()), f"phase {a} after phase {b}"
    with pytest.raises(ValueError, match="trace"):
        expert_decode.expert_decode_moe(x, routing, ws.queue, p["gate"], p["up"], p["shared_gate"], p["shared_up"],
                                        p["down"], p["shared_down"], ws.h_sorted[:pairs], config=config,
                                        trace=torch.zeros(3, 8, dtype=torch.int64, device="cuda"))
