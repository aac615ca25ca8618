"""kernels/tickets.py ACQ_REL: the "last CTA finishes" tickets and grid counters ordered by one
acquire-release atomic instead of fence.sc.gpu on each side. The values do not depend on it, so each
kernel that takes tickets must give the same bits both ways, launched again and again (the tickets
and counters reset themselves) and under PDL: decode attention (one and two merge levels, padding
requests), greedy argmax, the LM head's own argmax, and the grouped MoE (the ticket router,
moe_routing's sort, the decode experts' counts and cluster barrier)."""

import importlib

import pytest
import torch

from flint_sched.kernels import tickets
from flint_sched.kernels.attention import (TICKET_SLOTS, attention_workspace, decode_attention_full,
                                           decode_attention_sliding)
from flint_sched.kernels.grouped_moe import moe_grouped, moe_routing_workspace
from flint_sched.kernels.linear import linear
from flint_sched.kernels.moe import route, router_workspace
from flint_sched.kernels.sampling import greedy, pick_workspace
from executor_checks import assert_same_bits, ckpt, run  # noqa: F401 - ckpt: the fixture
from gpu_checks import gen
from moe_checks import make_moe

pytestmark = pytest.mark.gpu

G, H, D, BLOCK = 4, 32, 128, 16


def both_ways(monkeypatch, run):
    """run() with fence.sc tickets, then three times with acquire-release ones: all equal."""
    monkeypatch.setattr(tickets, "ACQ_REL", False)
    want = run()
    monkeypatch.setattr(tickets, "ACQ_REL", True)
    for _ in range(3):
        got = run()
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("lens,num_splits", [([1000], None), ([100_000], None), ([0, 513, 4097, 3], None),
                                             ([700, 4097], 128)], ids=["1k", "100k-two-levels", "mixed", "forced"])
def test_decode_attention_full(monkeypatch, lens, num_splits):
    g = gen(1)
    blocks_each = -(-max(lens) // BLOCK)
    pool = len(lens) * blocks_each + 1
    k = torch.randn(pool, BLOCK, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(pool, BLOCK, G, D, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(pool, device="cuda", generator=g)[:len(lens) * blocks_each].int().view(len(lens), -1)
    q = torch.randn(len(lens), H, D, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(H, device="cuda", generator=g).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ws = attention_workspace("cuda", max_splits=num_splits)

    def run():
        out = torch.full_like(q, float("nan"))
        decode_attention_full(q, k, v, tables, seq_lens, sinks, ws, max(lens), out=out, num_splits=num_splits,
                              pdl=True)
        torch.cuda.synchronize()
        assert int(ws[:TICKET_SLOTS].view(torch.int32).abs().sum()) == 0, "tickets not reset"
        return [out]

    both_ways(monkeypatch, run)


def test_decode_attention_sliding(monkeypatch):
    g = gen(2)
    lens = [513, 2000, 1]
    k = torch.randn(len(lens), 513, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(len(lens), H, D, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(H, device="cuda", generator=g).bfloat16()
    slots = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ws = attention_workspace("cuda")

    def run():
        out = torch.full_like(q, float("nan"))
        decode_attention_sliding(q, k, v, slots, seq_lens, sinks, ws, out=out, pdl=True)
        return [out]

    both_ways(monkeypatch, run)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_greedy_and_the_lm_heads_own_argmax(monkeypatch, rows):
    g = gen(rows)
    logits = torch.randn(rows, 151552, device="cuda", generator=g).bfloat16()
    w = (torch.randn(50_000, 256, device="cuda", generator=g) / 16).bfloat16()
    x = torch.randn(min(rows, 32), 256, device="cuda", generator=g).bfloat16()
    workspace = pick_workspace(32, "cuda")

    def run():
        ids = greedy(logits, pdl=True)
        head_ids = torch.full((x.shape[0],), -1, dtype=torch.int64, device="cuda")
        y = linear(x, w, pdl=True, argmax_out=head_ids, argmax_workspace=workspace)
        torch.cuda.synchronize()
        assert torch.equal(ids.long(), torch.argmax(logits, -1)) and torch.equal(head_ids, torch.argmax(y, -1))
        assert not workspace.any()
        return [ids, head_ids, y]

    both_ways(monkeypatch, run)


@pytest.mark.parametrize("tokens", [8, 16, 64, 200])
def test_the_grouped_moe(monkeypatch, tokens):
    """8-16 rows: the routed cluster decode experts (a cluster barrier after each gate/up unit); 64:
    moe_routing's sort and the decode experts' per-item counts; 200: the same on another config."""
    shape = dict(experts=256, top_k=6, hidden=2048, inter=512)
    p = make_moe("nvfp4", shape, seed=6)
    g = gen(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    residual = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    ws = moe_routing_workspace(tokens, 256, 6, "cuda", hidden_size=2048, intermediate_size=512)

    def run():
        out = torch.full_like(x, float("nan"))
        moe_grouped(x, p["router"], p["bias"], 6, 2.5, p["gate"], p["up"], p["down"], p["shared_gate"],
                    p["shared_up"], p["shared_down"], residual, ws, out=out, pdl=True)
        return [out, ws.ids[:tokens].clone()]

    both_ways(monkeypatch, run)


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_ticket_router(monkeypatch, tokens):
    g = gen(tokens + 7)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    gate = (torch.randn(256, 2048, device="cuda", generator=g) / 45).bfloat16()
    bias = 0.1 * torch.randn(256, device="cuda", generator=g)
    workspace = router_workspace(256, "cuda", tokens)

    def run():
        ids, weights = route(x, gate, bias, 6, 2.5, workspace=workspace, cluster=False, pdl=True)
        return [ids, weights]

    both_ways(monkeypatch, run)


@pytest.mark.parametrize("module,flag", [("flint_sched.kernels.moe", "ROUTER_ST_ASYNC"),
                                         ("flint_sched.kernels.tickets", "ACQ_REL")],
                         ids=["router_st_async", "acq_rel_tickets"])
def test_fewer_fences_change_no_logit(ckpt, monkeypatch, module, flag):
    """The cluster router's scores by st.async (kernels/moe.py ROUTER_ST_ASYNC) and the tickets'
    acquire-release ordering (kernels/tickets.py ACQ_REL) order the same values otherwise: the
    engine's logits and tokens bit for bit, graphs and eager, decode and prompt steps."""
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (3, 600, 37, 515, 90, 1)]
    limits = [2, 7, 3, 6, 4, 5]
    target = importlib.import_module(module)
    monkeypatch.setattr(target, flag, False)
    want, out_want, _ = run(ckpt, prompts, limits, seqs=6, budget=4096)
    monkeypatch.setattr(target, flag, True)
    for graphs in (True, False):
        got, out_got, _ = run(ckpt, prompts, limits, seqs=6, budget=4096, use_graphs=graphs)
        assert_same_bits((want, out_want), (got, out_got))
