"""kernel_ops.FOLD_NORMS, ROUTER_NORMS, FUSED_MOE, FUSED_QKV and LM_HEAD_ARGMAX on the CPU: the fused path's forward over recording stand-ins
for the kernels, counting which RMSNorms launch and which GEMVs and routers take a norm's weight (the
kernels themselves are checked on the GPU: tests/gpu/test_kernel_linear.py, test_kernel_moe.py,
test_cuda_executor.py)."""

from types import SimpleNamespace

import pytest
import torch

from flint_sched.config import preset
from flint_sched.executor import kernel_ops
from flint_sched.executor.forward import forward
from flint_sched.kernels.attention_front import qkv_fused_slots


class Weights(dict):
    def __init__(self, config):
        super().__init__({"lm_head.weight": torch.empty(config.vocab_size, config.hidden_size)})
        self.config = config

    def __missing__(self, name):
        return torch.empty(self.config.intermediate_size, self.config.hidden_size)


def stand_ins(monkeypatch, calls):
    def record(kind, result):
        calls.append(kind)
        return result

    monkeypatch.setattr(kernel_ops, "embed_tokens", lambda table, tokens, h, **kw: h)
    monkeypatch.setattr(kernel_ops, "rms_norm", lambda x, w, eps, out, pdl: record("norm", out))
    monkeypatch.setattr(kernel_ops, "linear", lambda x, w, out, pdl, norm_weight=None, **kw: record(
        ("linear", w.shape[0], norm_weight is not None), out))
    monkeypatch.setattr(kernel_ops, "gate_up_silu", lambda x, g, u, out, pdl: out)
    def route(x, *a, norm_weight=None, normed=None, **kw):
        if norm_weight is not None:
            calls.append("route+norm")
            assert normed.shape == x.shape and normed.data_ptr() != x.data_ptr()
        return torch.zeros(x.shape[0], 4, dtype=torch.int32), torch.zeros(x.shape[0], 4)

    monkeypatch.setattr(kernel_ops, "route", route)
    monkeypatch.setattr(kernel_ops, "moe_gate_up", lambda x, ids, *w, out, pdl: out)
    monkeypatch.setattr(kernel_ops, "moe_down", lambda hidden, ids, weights, *w, residual, out, pdl: out)
    monkeypatch.setattr(kernel_ops, "greedy", lambda logits, out, **kw: out)
    monkeypatch.setattr(kernel_ops, "attn", SimpleNamespace(
        qk_norm_rope_kv_sliding=lambda *a, q_out, pdl: q_out, qk_norm_rope_kv_full=lambda *a, q_out, pdl: q_out,
        decode_attention_sliding=lambda q, *a, out, **kw: out, decode_attention_full=lambda q, *a, out, **kw: out))


def fused_forward(config, rows=2):
    c = config
    qkv = {i: (torch.empty(c.q_size + 2 * c.kv_size, c.hidden_size), (c.q_size, c.q_size + c.kv_size))
           for i in range(c.num_hidden_layers)}
    kv = SimpleNamespace(ring={j: (None, None) for j in range(c.num_hidden_layers)}, ring_index=list(
        range(c.num_hidden_layers)), full={j: (None, None) for j in range(c.num_hidden_layers)},
        full_index=list(range(c.num_hidden_layers)))
    weights = kernel_ops.KernelWeights(c, Weights(c), qkv, kv, SimpleNamespace(router=None, attention=None,
                                                                               argmax=None, moe_counters=None,
                                                                               qkv_counters=None, pick="pick"))
    inputs = SimpleNamespace(num_rows=None, tokens=None, sources=None, sampled=None, table_scatter=None,
                             positions=torch.zeros(rows), ring_slots=torch.zeros(rows),
                             block_tables=torch.zeros(rows, 1), seq_lens=torch.zeros(rows), max_model_len=64,
                             argmax=None)
    ops = kernel_ops.KernelOps(weights, "fused", rows, torch.zeros(2, rows, c.hidden_size),
                               torch.zeros(rows, c.vocab_size), torch.zeros(rows, dtype=torch.int32), inputs)
    return forward(ops, c)


@pytest.mark.parametrize("fold,router", [(False, False), (True, False), (False, True), (True, True)])
def test_folded_norms_leave_only_the_norms_the_kernels_cannot_take(monkeypatch, fold, router):
    config = preset("flint-tiny")
    calls = []
    stand_ins(monkeypatch, calls)
    monkeypatch.setattr(kernel_ops, "FOLD_NORMS", fold)
    monkeypatch.setattr(kernel_ops, "ROUTER_NORMS", router)
    logits = fused_forward(config)
    assert logits.shape == (2, config.vocab_size)
    layers, qkv_rows = config.num_hidden_layers, config.q_size + 2 * config.kv_size
    moe_layers = sum(config.is_moe(i) for i in range(layers))
    assert 0 < moe_layers < layers
    # input norm a layer and the final one: into the GEMVs (fold); the MoE layers' post-attention
    # norms: into the router (router); the dense layers' post-attention norms always launch
    assert calls.count("norm") == (0 if fold else layers + 1) + (layers - moe_layers if router else layers)
    assert calls.count("route+norm") == (moe_layers if router else 0)
    folded = [c for c in calls if isinstance(c, tuple) and c[2]]
    assert folded == ([("linear", qkv_rows, True)] * layers + [("linear", config.vocab_size, True)] if fold else [])


@pytest.mark.parametrize("fmt,fits", [("nvfp4", True), ("bf16", True), ("nvfp4", False)])
def test_the_one_launch_moe_takes_each_moe_block_with_its_norm(monkeypatch, fmt, fits):
    """kernel_ops.FUSED_MOE: each MoE layer is one moe_fused launch over the row before its norm (no
    router, no expert launches, no post-attention norm), NVFP4 experts through shared-memory slots,
    BF16 read from global memory; shapes it does not take keep the three launches."""
    config = preset("flint-tiny")
    calls, asked = [], []
    stand_ins(monkeypatch, calls)
    monkeypatch.setattr(kernel_ops, "FUSED_MOE", True)
    monkeypatch.setattr(kernel_ops, "ROUTER_NORMS", False)
    monkeypatch.setattr(kernel_ops, "weight_format", lambda *w: fmt)
    monkeypatch.setattr(kernel_ops, "fused_moe_bytes", lambda *shape: asked.append(shape[-1]) or (1 if fits else None))

    def moe_fused(x, norm_weight, eps, router, bias, top_k, scaling, *weights_and_counters, residual, out, pdl):
        assert len(weights_and_counters) == 7 and x.data_ptr() == residual.data_ptr() != out.data_ptr()
        calls.append("moe_fused")
        return out

    monkeypatch.setattr(kernel_ops, "moe_fused", moe_fused)
    monkeypatch.setattr(kernel_ops, "moe_gate_up", lambda *a, **kw: calls.append("moe_gate_up") or kw["out"])
    fused_forward(config)
    layers = config.num_hidden_layers
    moe_layers = sum(config.is_moe(i) for i in range(layers))
    assert asked == [fmt == "nvfp4"] * moe_layers          # slots for NVFP4 only
    if fits:
        assert calls.count("moe_fused") == moe_layers and "moe_gate_up" not in calls
        assert calls.count("norm") == layers + 1 + layers - moe_layers
    else:
        assert "moe_fused" not in calls and calls.count("moe_gate_up") == moe_layers
        assert calls.count("norm") == 2 * layers + 1


@pytest.mark.parametrize("fmt,fits", [("nvfp4", True), ("bf16", True), ("nvfp4", False)])
def test_the_one_launch_attention_front_takes_each_layers_input_norm(monkeypatch, fmt, fits):
    """kernel_ops.FUSED_QKV: each layer's input norm, q/k/v and Q/K norm are one qkv_fused launch over
    the row before the norm, its K/V written to the ring (sliding layers, with RoPE) or through the
    block tables (full layers); NVFP4 through shared-memory slots, BF16 from global memory; shapes it
    does not take keep the launches."""
    config = preset("flint-tiny")
    calls, fronts, asked = [], [], []
    stand_ins(monkeypatch, calls)
    monkeypatch.setattr(kernel_ops, "FUSED_QKV", True)
    monkeypatch.setattr(kernel_ops, "ROUTER_NORMS", False)
    monkeypatch.setattr(kernel_ops, "weight_format", lambda *w: fmt)

    def qkv_fused(x, norm_weight, eps, weight, splits, qn, kn, positions, k_pool, v_pool, qk_eps, counters, *,
                  q_out, pdl, block_tables=None, ring_slots=None, rope_theta=None):
        assert x.shape == (2, config.hidden_size) and len(splits) == 2
        fronts.append("sliding" if ring_slots is not None and rope_theta else "full" if block_tables is not None
                      else "?")
        return q_out

    monkeypatch.setattr(kernel_ops, "front", SimpleNamespace(
        qkv_fused=qkv_fused, qkv_fused_slots=qkv_fused_slots,
        qkv_fused_bytes=lambda *shape: asked.append(shape[-1]) or (1 if fits else None)))
    fused_forward(config)
    layers = config.num_hidden_layers
    assert asked == [fmt == "nvfp4"] * layers             # slots for NVFP4 only
    if fits:
        assert fronts == ["sliding" if config.is_sliding(i) else "full" for i in range(layers)]
        assert not [c for c in calls if isinstance(c, tuple) and c[1] == config.q_size + 2 * config.kv_size]
        assert calls.count("norm") == layers + 1        # the post-attention norms and the final one
    else:
        assert fronts == [] and calls.count("norm") == 2 * layers + 1


@pytest.mark.parametrize("folded", [False, True])
def test_the_lm_head_makes_the_greedy_choice_itself(monkeypatch, folded):
    """kernel_ops.LM_HEAD_ARGMAX: the LM head's GEMV writes the step's greedy tokens (into next_tokens,
    over the pick workspace, gated by the inputs' argmax flag) and no argmax launches; off, it does."""
    config = preset("flint-tiny")
    calls, heads = [], []
    stand_ins(monkeypatch, calls)
    monkeypatch.setattr(kernel_ops, "LM_HEAD_ARGMAX", folded)
    monkeypatch.setattr(kernel_ops, "greedy", lambda logits, out, **kw: calls.append("greedy") or out)

    def linear(x, w, out, pdl, norm_weight=None, argmax_out=None, argmax_workspace=None, argmax_active=None, **kw):
        if w.shape[0] == config.vocab_size:
            heads.append((argmax_out is not None, argmax_workspace, argmax_active))
            if argmax_out is not None:
                assert argmax_out.shape == (2,) and argmax_out.dtype == torch.int32
        return out

    monkeypatch.setattr(kernel_ops, "linear", linear)
    logits = fused_forward(config)
    assert logits.shape == (2, config.vocab_size)
    assert heads == [(True, "pick", None) if folded else (False, None, None)]
    assert calls.count("greedy") == (0 if folded else 1)
