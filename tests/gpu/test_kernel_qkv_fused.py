"""qkv_fused (cuda/qkv_fused.cu): a fused decode step's input norm, q/k/v GEMV, Q/K norms, RoPE and
K/V write in one launch, bit for bit the three launches it stands for (`rms_norm`, `linear` on 4
warps, `qk_norm_rope_kv_sliding` / `_full`, each checked against the reference in its own tests):
the q rows, the q/k/v rows and every byte of both KV pools. A cluster a head and a grid on a counter;
NVFP4 weights through shared-memory slots and read from global memory, BF16 weights; Flint's shapes
and a small real-shaped layer, 1-8 rows (one a padding row that writes nothing), sliding and full
layers, bf16 and e4m3 caches, the fewest CTAs the slots allow, two CTAs a SM, repeated launches and a
CUDA graph."""

import importlib

import pytest
import torch

from flint_sched.kernels.attention import qk_norm_rope_kv_full, qk_norm_rope_kv_sliding
from flint_sched.kernels.attention_front import qkv_fused, qkv_fused_bytes
from flint_sched.kernels.linear import concat_rows, linear
from flint_sched.kernels.norm import rms_norm
from flint_sched.kernels.smem_tiles import grid_counters
from flint_sched.quant.nvfp4 import quantize
from gpu_checks import gen

front = importlib.import_module("flint_sched.kernels.attention_front")

pytestmark = pytest.mark.gpu

FLINT = dict(hidden=2048, kv_heads=4)
SMALL = dict(hidden=512, kv_heads=2)     # tests/gpu/gpu_checks.py small_real_config
EPS, QK_EPS, THETA, WINDOW, BLOCK = 1e-5, 1e-6, 10000.0, 513, 16
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module", params=[("nvfp4", FLINT), ("nvfp4", SMALL), ("bf16", FLINT), ("bf16", SMALL)],
                ids=["nvfp4-flint", "nvfp4-small", "bf16-flint", "bf16-small"])
def weights(request):
    fmt, shape = request.param
    k, g = shape["hidden"], shape["kv_heads"]
    gn = gen(3)
    parts = [torch.randn(rows, k, device="cuda", generator=gn) / k**0.5 for rows in (8 * g * 128, g * 128, g * 128)]
    weight, splits = concat_rows([quantize(w) if fmt == "nvfp4" else w.bfloat16() for w in parts])
    return dict(fmt=fmt, shape=shape, weight=weight, splits=splits,
                norm=(1 + 0.2 * torch.randn(k, device="cuda", generator=gn)).bfloat16(),
                q_norm=(1 + 0.3 * torch.randn(128, device="cuda", generator=gn)).bfloat16(),
                k_norm=(1 + 0.3 * torch.randn(128, device="cuda", generator=gn)).bfloat16())


@pytest.fixture(params=["slots-heads", "direct-heads", "slots-heads_st", "direct-heads_st", "slots-grid",
                        "direct-grid"])
def layer(request, weights, monkeypatch):
    """NVFP4 tiles through shared-memory slots or read from global memory (BF16: read), by a cluster a
    head (QKV_FUSED_HEADS; heads_st: the rows to CTA 0 by st.async, QKV_HEADS_ST_ASYNC) or by a grid of
    resident CTAs on a counter."""
    path, kind = request.param.split("-")
    if weights["fmt"] == "bf16" and path == "slots":
        pytest.skip("a BF16 q/k/v weight is read from global memory only")
    monkeypatch.setattr(front, "QKV_FUSED_NVFP4_SLOTS", path == "slots")
    monkeypatch.setattr(front, "QKV_FUSED_HEADS", kind != "grid")
    monkeypatch.setattr(front, "QKV_HEADS_ST_ASYNC", kind == "heads_st")
    return weights


def case(layer, tokens, sliding, kv_dtype, seed):
    k, g = layer["shape"]["hidden"], layer["shape"]["kv_heads"]
    gn = gen(seed)
    x = (4 * torch.randn(tokens, k, device="cuda", generator=gn)).bfloat16()
    positions = torch.randint(0, 5000, (tokens,), device="cuda", generator=gn).int()
    if tokens > 2:
        positions[1] = -1                     # a padding row: its K/V is not written
    if sliding and tokens > 3:
        positions[2] = 262_143                # RoPE at the longest context (the ring keeps p % rows)
    if sliding:
        where = dict(ring_slots=torch.randperm(tokens + 2, device="cuda", generator=gn)[:tokens].int())
        shape = (tokens + 2, WINDOW, g, 128)
    else:
        where = dict(block_tables=torch.randperm(tokens * 400, device="cuda", generator=gn).int().view(tokens, 400))
        shape = (tokens * 400, BLOCK, g, 128)
    pools = [torch.randn(shape, device="cuda", generator=gn).to(kv_dtype) for _ in range(2)]
    return x, positions, where, pools


def launches(layer, x, positions, where, pools):
    pools = [p.clone() for p in pools]
    normed = rms_norm(x, layer["norm"], EPS)
    qkv = linear(normed, layer["weight"], row_splits=layer["splits"], warps=4)
    if "ring_slots" in where:
        q = qk_norm_rope_kv_sliding(qkv, layer["q_norm"], layer["k_norm"], positions, *pools, where["ring_slots"],
                                    QK_EPS, THETA)
    else:
        q = qk_norm_rope_kv_full(qkv, layer["q_norm"], layer["k_norm"], positions, *pools, where["block_tables"],
                                 QK_EPS)
    return q, qkv, pools


def one_launch(layer, x, positions, where, pools, counters, pdl=False):
    pools = [p.clone() for p in pools]
    n = layer["weight"].shape[0]
    qkv = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    rope = dict(rope_theta=THETA) if "ring_slots" in where else {}
    q = qkv_fused(x, layer["norm"], EPS, layer["weight"], layer["splits"], layer["q_norm"], layer["k_norm"], positions,
                  *pools, QK_EPS, counters, qkv=qkv, pdl=pdl, **where, **rope)
    return q, qkv, pools


def check_same(got, want, what):
    (q, qkv, pools), (want_q, want_qkv, want_pools) = got, want
    assert torch.equal(qkv, want_qkv), f"{what}: q/k/v rows differ in {(qkv != want_qkv).sum()} values"
    assert torch.equal(q, want_q), f"{what}: q differs in {(q != want_q).sum()} values"
    for name, a, b in zip("KV", pools, want_pools, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: the {name} pool differs"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16-cache", "e4m3-cache"])
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 6, 8])
def test_one_launch_is_the_three_launches_bit_for_bit(layer, tokens, sliding, kv_dtype):
    k, g = layer["shape"]["hidden"], layer["shape"]["kv_heads"]
    assert qkv_fused_bytes(tokens, 10 * g * 128, k, front.qkv_fused_slots(layer["fmt"])) is not None
    x, positions, where, pools = case(layer, tokens, sliding, kv_dtype, seed=tokens)
    want = launches(layer, x, positions, where, pools)
    counters = grid_counters("cuda")
    for launch in range(3):
        check_same(one_launch(layer, x, positions, where, pools, counters, pdl=launch > 0), want,
                   f"T={tokens} launch {launch}")
        assert counters.tolist() == [0, 0], "the counters stay (the grid kind: are left) zero"
    if front.QKV_FUSED_HEADS:      # a cluster a head waits on no counter: none need be given
        check_same(one_launch(layer, x, positions, where, pools, None), want, f"T={tokens} without counters")


@pytest.mark.parametrize("grid", ["fewest", "two-a-sm"])
def test_other_grids(layer, grid, monkeypatch):
    """The grid kind: the fewest CTAs whose slots hold every tile (several tiles a CTA, the last CTAs one
    fewer), and two CTAs a SM (QKV_FUSED_CTAS = 2: registers capped at 128)."""
    if front.QKV_FUSED_HEADS:
        pytest.skip("a cluster a head has one grid")
    n_tiles = layer["weight"].shape[0] // 16
    if grid == "fewest":
        fewest = -(-n_tiles // front.QKV_FUSED_SLOTS)
        monkeypatch.setattr(front, "_resident", lambda kernel, size, device: fewest)
    else:
        monkeypatch.setattr(front, "QKV_FUSED_CTAS", 2)
    x, positions, where, pools = case(layer, 5, True, torch.bfloat16, seed=11)
    check_same(one_launch(layer, x, positions, where, pools, grid_counters("cuda")),
               launches(layer, x, positions, where, pools), grid)


def test_in_a_cuda_graph_replays_bit_for_bit(layer):
    x, positions, where, pools = case(layer, 4, False, torch.bfloat16, seed=12)
    want = launches(layer, x, positions, where, pools)
    counters = grid_counters("cuda")
    one_launch(layer, x, positions, where, pools, counters, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [one_launch(layer, x, positions, where, pools, counters, pdl=True) for _ in range(2)]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            check_same(out, want, "graph replay")
    assert counters.tolist() == [0, 0]


def test_bad_arguments_are_refused_before_the_launch(layer):
    x, positions, where, pools = case(layer, 2, True, torch.bfloat16, seed=13)
    counters = grid_counters("cuda")
    args = (layer["norm"], EPS, layer["weight"], layer["splits"], layer["q_norm"], layer["k_norm"], positions, *pools,
            QK_EPS, counters)
    with pytest.raises(ValueError, match="block_tables .* or ring_slots"):
        qkv_fused(x, *args)
    with pytest.raises(ValueError, match="rope_theta must be positive"):
        qkv_fused(x, *args, **where)
    with pytest.raises(ValueError, match="row_splits must be"):
        qkv_fused(x, *args[:3], (128,), *args[4:], **where, rope_theta=THETA)
    with pytest.raises(ValueError, match="counters"):
        qkv_fused(x, *args[:-1], torch.zeros(2, dtype=torch.int64, device="cuda"), **where, rope_theta=THETA)
    t, h = x.shape[0], 8 * layer["shape"]["kv_heads"]
    unaligned = torch.empty(t * h * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(t, h, 128)
    with pytest.raises(ValueError, match="q_out"):
        qkv_fused(x, *args, **where, rope_theta=THETA, q_out=unaligned)
    if layer["fmt"] == "nvfp4" and front.QKV_FUSED_NVFP4_SLOTS:   # a bulk copy's source: 16-byte aligned
        w = layer["weight"]
        shifted = torch.empty(w.block_scales.numel() + 2, dtype=torch.uint8, device="cuda")[2:]
        shifted = shifted.view(w.block_scales.shape).copy_(w.block_scales)
        moved = type(w)(w.codes, shifted, w.tensor_scale)
        with pytest.raises(ValueError, match="block_scales must start at a 16-byte"):
            qkv_fused(x, *args[:2], moved, *args[3:], **where, rope_theta=THETA)
