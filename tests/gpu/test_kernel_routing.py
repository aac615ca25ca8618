"""The grouped path's routing (cuda/moe_routing.cu) on its own: the sigmoid top-k against route()'s
formula (model/reference.py), of the logits or of their split-K parts, and the counting sort's
metadata (per-expert rows, pair <-> row maps, the work lists) for any token count, by histograms
or by token masks."""

import pytest
import torch

from flint_sched.kernels import grouped_moe, moe_routing_workspace, route_and_sort
from flint_sched.kernels.grouped_moe import route_and_split
from gpu_checks import gen
from moe_checks import SCALING

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 9, 63, 257, 4099]


def reference_topk(logits, bias, top_k):
    scores = torch.sigmoid(logits)
    chosen = torch.topk(scores + bias, top_k, dim=-1).indices
    w = scores.gather(1, chosen)
    return chosen.int(), w / w.sum(dim=-1, keepdim=True) * SCALING


def check_metadata(r, ids, ntok, m, top_k, experts, heavy_first=False):
    """Every real pair once, counts and offsets, pair_row <-> sorted_token, stable order, and the
    work list covering every sorted row exactly once in items of one expert, in expert order (with
    heavy_first: the experts of more than chunk / 2 rows first, each part in expert order)."""
    a1, big = top_k + 1, experts
    offsets, st, pr = r.offsets.cpu().long(), r.sorted_token.cpu().long(), r.pair_row.cpu().long()
    ids = ids[:ntok].cpu().long()
    pairs = ntok * a1
    counts = torch.bincount(ids.flatten(), minlength=experts + 1)
    counts[big] += ntok
    assert offsets[0] == 0 and torch.equal(offsets.diff(), counts), "offsets are not the per-expert counts"
    assert (pr[ntok:] == -1).all(), "padded tokens have sorted rows"
    rows = pr[:ntok].flatten()
    assert torch.equal(rows.sort().values, torch.arange(pairs)), "pair_row is not a permutation of the rows"
    assert torch.equal(st[rows], torch.arange(ntok).repeat_interleave(a1)), "sorted_token != token of pair"
    expert_of_row = torch.searchsorted(offsets, torch.arange(pairs), right=True) - 1
    slot_expert = torch.cat([ids, torch.full((ntok, 1), big)], dim=1).flatten()
    assert torch.equal(expert_of_row[rows], slot_expert), "a pair sits in another expert's rows"
    for e in range(experts + 1):   # stable: tokens ascending within an expert
        seg = st[offsets[e]:offsets[e + 1]]
        assert (seg.diff() > 0).all(), f"expert {e}: rows not in token order"
    n = int(r.num_work)
    assert n <= r.max_items, f"{n} items > bound {r.max_items}"
    we, wr = r.work_expert[:n].cpu().long(), r.work_row[:n].cpu().long()
    heavy = (counts * 2 > r.chunk)[we] if heavy_first else torch.zeros(n, dtype=torch.bool)
    assert (heavy.int().diff() <= 0).all(), "a light expert's item before a heavy one's"
    key = we * (pairs + 1) + wr   # expert, then first row
    for part in (key[heavy], key[~heavy]):
        assert (part.diff() > 0).all(), "items out of expert or row order (an expert's items not adjacent)"
    covered = torch.zeros(pairs, dtype=torch.int64)
    for e, row in zip(we.tolist(), wr.tolist()):
        end = min(row + r.chunk, int(offsets[e + 1]))
        assert offsets[e] <= row < end, f"item ({e}, {row}) outside its expert"
        covered[row:end] += 1
    assert (covered == 1).all(), "work items do not cover every row exactly once"


@pytest.mark.parametrize("mask_tokens", [0, 256], ids=["histograms", "masks"])
@pytest.mark.parametrize("heavy_first", [False, True], ids=["by-expert", "heavy-first"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("experts", [32, 256])
@pytest.mark.parametrize("tokens", TOKENS + [16, 17, 256])  # moe_route: one CTA to 16 tokens (ids in shared memory)
def test_route_and_sort(tokens, experts, fused, heavy_first, mask_tokens, monkeypatch):
    """moe_route's sort by per-expert token masks (up to SORT_MASK_TOKENS tokens) or histograms."""
    monkeypatch.setattr(grouped_moe, "SORT_MASK_TOKENS", mask_tokens)
    top_k = 6
    g = gen(tokens + experts)
    logits = 2 * torch.randn(tokens, experts, device="cuda", generator=g)
    bias = 0.1 * torch.randn(experts, device="cuda", generator=g)
    ws = moe_routing_workspace(tokens, experts, top_k, "cuda")
    for ntok in sorted({tokens, max(0, tokens - 5)}):
        num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
        ws.ids.fill_(-7)
        ws.queue.fill_(5)
        r = route_and_sort(logits, bias, top_k, SCALING, ws, num_tokens=num_tokens, fused=fused,
                           heavy_first=heavy_first)
        ref_ids, ref_w = reference_topk(logits, bias, top_k)
        assert torch.equal(r.ids[:ntok], ref_ids[:ntok]), "ids differ from route()"
        torch.testing.assert_close(r.weights[:ntok], ref_w[:ntok], rtol=2e-6, atol=1e-7)
        assert (r.ids[ntok:] == -7).all(), "padded tokens were routed"
        check_metadata(r, r.ids, ntok, tokens, top_k, experts, heavy_first)
        assert (ws.queue[:int(r.num_work) + 1] == 0).all(), "expert_decode_moe's queue not zeroed"
        assert int(ws.ticket) == 0, "ticket not reset"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("parts", [2, 8])
@pytest.mark.parametrize("tokens", [1, 16, 17, 256])
def test_route_and_sort_of_split_k_parts(tokens, parts, fused):
    """Logits as split-K parts [S, M, E]: routed as their sum, added in part order."""
    top_k, experts = 6, 256
    g = gen(tokens + parts)
    logit_parts = torch.randn(parts, tokens, experts, device="cuda", generator=g)
    bias = 0.1 * torch.randn(experts, device="cuda", generator=g)
    logits = logit_parts[0].clone()
    for q in range(1, parts):
        logits += logit_parts[q]
    ws = moe_routing_workspace(tokens, experts, top_k, "cuda")
    ntok = max(1, tokens - 3)
    num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
    r = route_and_sort(logit_parts, bias, top_k, SCALING, ws, num_tokens=num_tokens, fused=fused)
    ref_ids, ref_w = reference_topk(logits, bias, top_k)
    assert torch.equal(r.ids[:ntok], ref_ids[:ntok]), "ids differ from route() of the summed parts"
    torch.testing.assert_close(r.weights[:ntok], ref_w[:ntok], rtol=2e-6, atol=1e-7)
    check_metadata(r, r.ids, ntok, tokens, top_k, experts, True)


@pytest.mark.parametrize("m", [9, 16, 100, 256, 257])
def test_router_logits_split_k(m, monkeypatch):
    """router_logits: split-K parts up to ROUTER_SPLIT_MAX_ROWS rows (their sum the product), one
    [M, E] product above."""
    monkeypatch.setattr(grouped_moe, "ROUTER_SPLIT_K", 8)
    monkeypatch.setattr(grouped_moe, "ROUTER_SPLIT_MAX_ROWS", 256)
    g = gen(m)
    x = torch.randn(m, 2048, device="cuda", generator=g).bfloat16()
    gate = (0.02 * torch.randn(256, 2048, device="cuda", generator=g)).bfloat16()
    ws = moe_routing_workspace(m, 256, 6, "cuda")
    logits = grouped_moe.router_logits(x, gate, ws)
    assert logits.shape == ((8, m, 256) if m <= 256 else (m, 256))
    total = logits.sum(0) if logits.dim() == 3 else logits
    torch.testing.assert_close(total, x.float() @ gate.float().t(), rtol=1e-4, atol=1e-4)


def check_split_lists(small, tiled, ntok, split):
    """route_and_split's two work lists: the experts of at most `split` rows in the first (items of
    its chunk), the others in the tiled one (items of 128 rows), each in expert order, each sorted
    row in exactly one item of one list."""
    offsets = small.offsets.cpu().long()
    counts = offsets.diff()
    pairs = int(offsets[-1])
    covered = torch.zeros(pairs, dtype=torch.int64)
    for r, heavy in ((small, False), (tiled, True)):
        n = int(r.num_work)
        assert n <= r.max_items, f"{n} items > bound {r.max_items}"
        we, wr = r.work_expert[:n].cpu().long(), r.work_row[:n].cpu().long()
        assert ((counts[we] > split) == heavy).all(), f"an expert in the wrong list (split {split})"
        assert ((we * (pairs + 1) + wr).diff() > 0).all(), "items out of expert or row order"
        for e, row in zip(we.tolist(), wr.tolist()):
            end = min(row + r.chunk, int(offsets[e + 1]))
            assert offsets[e] <= row < end, f"item ({e}, {row}) outside its expert"
            covered[row:end] += 1
    assert (covered == 1).all(), "the two lists do not cover every row exactly once"
    assert pairs == ntok * (small.ids.shape[1] + 1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("split", [4, 32])
@pytest.mark.parametrize("tokens", [1, 16, 100, 600, 4099])
def test_route_and_split(tokens, split, fused):
    """Two work lists from one sort (hybrid expert GEMMs), five experts made heavy by the bias; the
    routing itself as route_and_sort's (same ids, weights, sorted rows)."""
    top_k, experts = 6, 256
    g = gen(tokens + split)
    logits = 2 * torch.randn(tokens, experts, device="cuda", generator=g)
    bias = 0.1 * torch.randn(experts, device="cuda", generator=g)
    bias[[3, 50, 51, 200, 255]] += 3.0
    ws = moe_routing_workspace(tokens, experts, top_k, "cuda")
    for ntok in sorted({tokens, max(1, tokens - 5)}):
        num_tokens = torch.tensor([ntok], dtype=torch.int32, device="cuda")
        plain = route_and_sort(logits, bias, top_k, SCALING, ws, num_tokens=num_tokens, fused=fused, chunk=16)
        expected = [t.clone() for t in (plain.ids, plain.weights, plain.offsets, plain.sorted_token, plain.pair_row)]
        ws.queue.fill_(5)
        small, tiled = route_and_split(logits, bias, top_k, SCALING, ws, 16, split, num_tokens=num_tokens,
                                       fused=fused)
        got = (small.ids, small.weights, small.offsets, small.sorted_token, small.pair_row)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the sort differs from route_and_sort's"
        check_split_lists(small, tiled, ntok, split)
        assert (ws.queue[:int(small.num_work) + 1] == 0).all(), "expert_decode_moe's queue not zeroed"
        if tokens >= 100:
            assert int(tiled.num_work) > 0 and int(small.num_work) > 0, "a list is empty: the case tests nothing"
