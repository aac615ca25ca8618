"""The reference model, piece by piece on cases computed by hand, and as a whole."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import fp32_weights
from flint_sched.model.reference import (FlintReference, KVState, apply_rope, attention_with_sinks,
                                         rms_norm, route)


def test_rms_norm_by_hand():
    out = rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, 0.5]), eps=0.0)
    r = math.sqrt((9 + 16) / 2)
    assert torch.allclose(out, torch.tensor([[3 / r * 2, 4 / r * 0.5]]))


def test_sink_term_by_hand():
    # one head, two keys; scores 1 and 2 (D = 1, scale 1), sink logit 0.5
    q = torch.tensor([[[1.0]]])
    k = torch.tensor([[[1.0]], [[2.0]]])
    v = torch.tensor([[[10.0]], [[20.0]]])
    out = attention_with_sinks(q, k, v, torch.tensor([0.5]), torch.tensor([1]), torch.tensor([0, 1]), None)
    denom = math.exp(0.5) + math.exp(1) + math.exp(2)
    expected = (math.exp(1) * 10 + math.exp(2) * 20) / denom
    assert out.item() == pytest.approx(expected, rel=1e-6)
    # equivalently: out_without_sink * sigmoid(lse - sink)
    lse = math.log(math.exp(1) + math.exp(2))
    no_sink = (math.exp(1) * 10 + math.exp(2) * 20) / math.exp(lse)
    assert out.item() == pytest.approx(no_sink / (1 + math.exp(0.5 - lse)), rel=1e-6)


def test_window_edge_512_513():
    # query at 600, window 513: key 88 = 600 - 512 is the oldest visible one, 87 is not.
    positions = torch.arange(80, 601)
    s = positions.numel()
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(s, 1, 4)
    v = torch.zeros(s, 1, 4)
    v[positions == 87, 0, 0] = 1.0
    v[positions == 88, 0, 1] = 1.0
    out = attention_with_sinks(q, k, v, torch.tensor([-1e9]), torch.tensor([600]), positions, 513)[0, 0]
    assert out[0] == 0.0
    assert out[1] == pytest.approx(1 / 513)          # equal scores: 513 visible keys
    out_full = attention_with_sinks(q, k, v, torch.tensor([-1e9]), torch.tensor([600]), positions, None)[0, 0]
    assert out_full[0] == pytest.approx(1 / s)


def test_causal_and_gqa_head_mapping():
    # 4 query heads over 2 kv heads: heads 0,1 read kv head 0; heads 2,3 read kv head 1.
    q = torch.zeros(1, 4, 2)
    k = torch.zeros(1, 2, 2)
    v = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    out = attention_with_sinks(q, k, v, torch.full((4,), -1e9), torch.tensor([0]), torch.tensor([0]), None)
    assert torch.equal(out[0], torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]))
    # a key in the future is invisible
    out = attention_with_sinks(torch.zeros(1, 1, 1), torch.zeros(2, 1, 1), torch.tensor([[[1.0]], [[5.0]]]),
                               torch.tensor([-1e9]), torch.tensor([0]), torch.tensor([0, 1]), None)
    assert out.item() == 1.0


def test_router_choice_flipped_by_bias():
    # logits 2.0, 1.0, 0.0 for three experts, top-2
    x = torch.tensor([[1.0]])
    gate = torch.tensor([[2.0], [1.0], [0.0]])
    chosen, weights = route(x, gate, torch.zeros(3), top_k=2, scaling=2.5)
    assert chosen[0].tolist() == [0, 1]
    chosen, weights = route(x, gate, torch.tensor([0.0, 0.0, 0.5]), top_k=2, scaling=2.5)
    assert sorted(chosen[0].tolist()) == [0, 2]        # sigmoid(0) + 0.5 beats sigmoid(1)
    s0, s2 = 1 / (1 + math.exp(-2)), 0.5                # weights use the scores, not the bias
    got = dict(zip(chosen[0].tolist(), weights[0].tolist()))
    assert got[0] == pytest.approx(s0 / (s0 + s2) * 2.5) and got[2] == pytest.approx(s2 / (s0 + s2) * 2.5)


def test_rope_by_hand():
    # D = 4: dimension 0 pairs with 2, 1 with 3; inverse frequencies 1 and theta^-0.5
    x = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]])
    out = apply_rope(x, torch.tensor([3]), theta=100.0)[0, 0]
    a, b = 3.0, 3.0 / 10.0
    assert torch.allclose(out, torch.tensor([math.cos(a), math.cos(b), math.sin(a), math.sin(b)]), atol=1e-6)
    assert torch.equal(apply_rope(x, torch.tensor([0]), theta=100.0), x)


def _attention_output(config, weights, layer, spacing):
    """Layer `layer` attention over 6 tokens at positions 0, spacing, 2 × spacing, …"""
    model = FlintReference(config, weights)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(1))
    return model.attention(layer, x, torch.arange(6) * spacing, KVState())


def test_nope_full_layers_ignore_positions_rope_layers_do_not(tiny_config):
    """RoPE depends on distances, NoPE does not: spread the same tokens 100 positions apart."""
    weights = fp32_weights(tiny_config)
    full, sliding = tiny_config.full_layers[0], tiny_config.sliding_layers[0]
    assert torch.allclose(_attention_output(tiny_config, weights, full, 1),
                          _attention_output(tiny_config, weights, full, 100), atol=1e-5)
    assert not torch.allclose(_attention_output(tiny_config, weights, sliding, 1),
                              _attention_output(tiny_config, weights, sliding, 100), atol=1e-3)


def test_moe_equals_dense_formulation(tiny_config):
    """Every expert run on every token, masked by the routing weights (a different formulation)."""
    c, weights = tiny_config, fp32_weights(tiny_config)
    model = FlintReference(c, weights)
    i = c.first_k_dense_replace
    p = f"model.layers.{i}.mlp."
    x = torch.randn(9, c.hidden_size, generator=torch.Generator().manual_seed(2))
    scores = torch.sigmoid(x @ weights[p + "gate.weight"].t())
    chosen = torch.topk(scores + weights[p + "gate.e_score_correction_bias"], c.num_experts_per_tok).indices
    mask = torch.zeros_like(scores).scatter(1, chosen, 1.0)
    w = scores * mask
    w = w / w.sum(-1, keepdim=True) * c.routed_scaling_factor           # [T, E]
    g = torch.einsum("th,eih->tei", x, weights[p + "experts.gate_proj.weight"])
    u = torch.einsum("th,eih->tei", x, weights[p + "experts.up_proj.weight"])
    y = torch.einsum("tei,ehi->teh", F.silu(g) * u, weights[p + "experts.down_proj.weight"])
    expected = (y * w[..., None]).sum(1)
    s = p + "shared_experts."
    expected += (F.silu(x @ weights[s + "gate_proj.weight"].t()) * (x @ weights[s + "up_proj.weight"].t())) @ \
        weights[s + "down_proj.weight"].t()
    assert torch.allclose(model.moe(i, x), expected, atol=1e-5)


def _check_incremental(config, num_tokens, chunks, seed=0):
    model = FlintReference(config, fp32_weights(config, seed))
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    full = model.forward(ids)
    state, parts, start = KVState(), [], 0
    for size in chunks:
        parts.append(model.forward(ids[start:start + size], state))
        start += size
    assert start == num_tokens
    torch.testing.assert_close(torch.cat(parts), full, atol=2e-4, rtol=1e-4)
    return full


def test_prefill_then_decode_equals_full_forward_past_the_window(tiny_short_window):
    # window 8; 40 tokens: prefill 5, chunks of odd sizes crossing the window, then token by token
    full = _check_incremental(tiny_short_window, 40, [5, 3, 9, 1, 2] + [1] * 20)
    assert torch.isfinite(full).all() and full.std() > 0.1


def test_incremental_with_the_real_window(tiny_config):
    assert tiny_config.sliding_window == 513
    _check_incremental(tiny_config, 530, [500, 20] + [1] * 10)


def test_window_changes_the_result(tiny_config, tiny_short_window):
    """The sliding window is really applied: a long sequence differs with window 8 vs 513."""
    ids = torch.arange(30) % tiny_config.vocab_size
    a = FlintReference(tiny_config, fp32_weights(tiny_config)).forward(ids)
    b = FlintReference(tiny_short_window, fp32_weights(tiny_config)).forward(ids)
    assert torch.allclose(a[:8], b[:8], atol=1e-5) and not torch.allclose(a[20:], b[20:], atol=1e-3)


def test_forty_nine_layers_stay_finite_and_non_degenerate(tiny_config):
    deep = dataclasses.replace(tiny_config, num_hidden_layers=49, layer_types=tuple(
        "full_attention" if i % 7 in (3, 6) else "sliding_attention" for i in range(49)))
    model = FlintReference(deep, fp32_weights(deep))
    hidden = []
    logits = model.forward(torch.arange(16), hidden_out=hidden)
    norms = torch.stack([h.norm(dim=-1).mean() for h in hidden])
    assert torch.isfinite(logits).all() and logits.std() > 0.3
    assert norms.max() / norms.min() < 50
    assert (logits.argmax(-1).unique().numel() > 1)
