"""kernel_ops.FOLD_NORMS, ROUTER_NORMS, LM_HEAD_ARGMAX and MOE_SPLIT_MAX_ROWS on the CPU: the fused path's forward over recording stand-ins
for the kernels, counting which RMSNorms launch and which GEMVs and routers take a norm's weight (the
kernels themselves are checked on the GPU: tests/gpu/test_kernel_linear.py, test_kernel_moe.py,
test_cuda_executor.py)."""

from types import SimpleNamespace

import pytest
import torch

from flint_sched.config import preset
from flint_sched.executor import kernel_ops
from flint_sched.executor.forward import forward
from flint_sched.kernels.moe import _shared_expert_args
from flint_sched.kernels.moe import moe_split_fits as moe_kernels_fits
from flint_sched.quant.nvfp4 import NVFP4Tensor


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
    weights = kernel_ops.KernelWeights(c, Weights(c), qkv, kv, SimpleNamespace(
        router=None, attention=None, argmax=None, pick="pick",
        moe_acc=torch.zeros(8, c.hidden_size, dtype=torch.int64)))
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


@pytest.mark.parametrize("rows", [1, 2])
def test_the_split_moe_takes_batch_1_and_its_norm_clears_the_sum(monkeypatch, rows):
    """kernel_ops.MOE_SPLIT_MAX_ROWS (1): a one-row fused step runs each MoE layer's experts as one
    moe_split into the workspace's fixed-point sum, then add_rms_norm_fixed over that sum (the norm
    that follows, or at the last layer one whose output is unused), writing the layer's hidden state;
    two rows take moe_gate_up and moe_down."""
    config = preset("flint-tiny")
    calls = []
    stand_ins(monkeypatch, calls)
    monkeypatch.setattr(kernel_ops, "moe_gate_up", lambda x, ids, *w, out, pdl: calls.append("gate_up") or out)
    monkeypatch.setattr(kernel_ops, "moe_down", lambda h, ids, weights, *w, residual, out, pdl: calls.append("down") or out)
    fits = []
    monkeypatch.setattr(kernel_ops, "moe_split_fits", lambda *a: fits.append(a) or True)  # bf16 stand-ins
    sums = []

    def moe_split(x, ids, weights, *experts, acc, pdl):
        assert len(experts) == 6 and acc.dtype == torch.int64 and acc.shape == (rows, config.hidden_size)
        sums.append(acc.data_ptr())
        calls.append("split")
        return acc

    def add_rms_norm_fixed(acc, residual, weight, eps, out, residual_out, pdl):
        assert acc.data_ptr() == sums[-1] and out.shape == residual_out.shape == residual.shape
        calls.append("fixed_norm")
        return out, residual_out

    monkeypatch.setattr(kernel_ops, "moe_split", moe_split)
    monkeypatch.setattr(kernel_ops, "add_rms_norm_fixed", add_rms_norm_fixed)
    assert fused_forward(config, rows=rows).shape == (rows, config.vocab_size)
    moe_layers = sum(config.is_moe(i) for i in range(config.num_hidden_layers))
    if rows == 1:
        assert calls.count("split") == moe_layers and "gate_up" not in calls and "down" not in calls
        assert calls.count("fixed_norm") == moe_layers
        assert len(set(sums)) == 1 and all(a[1:] == (config.hidden_size, config.moe_intermediate_size, 1) for a in fits)
    else:
        assert calls.count("gate_up") == calls.count("down") == moe_layers and "split" not in calls


def test_the_split_moe_fits_nvfp4_experts_of_flint_shapes():
    c = preset("flint")
    assert moe_kernels_fits("nvfp4", c.hidden_size, c.moe_intermediate_size, 1)
    assert moe_kernels_fits("nvfp4", c.hidden_size, c.moe_intermediate_size, 8)
    assert not moe_kernels_fits("bf16", c.hidden_size, c.moe_intermediate_size, 1)       # 64 KB tiles
    assert not moe_kernels_fits("nvfp4", c.hidden_size, c.moe_intermediate_size, 9)
    assert not moe_kernels_fits("nvfp4", 64, 64, 1)                                      # flint-tiny
    assert not moe_kernels_fits("nvfp4", 4096, c.moe_intermediate_size, 1)               # > 2 down tiles a warp


def test_the_moe_launchers_take_a_whole_shared_expert_or_none():
    """kernels/moe.py's launchers pass the shared expert's weights checked, in order, or null pointers
    in their places (3 an NVFP4 weight, 1 a bf16 one); a partial one is refused."""
    def nvfp4(n, k):
        return NVFP4Tensor(torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.uint8),
                           torch.ones(1))
    cpu = torch.device("cpu")
    gate, up, down = nvfp4(256, 512), nvfp4(256, 512), nvfp4(512, 256)
    weights = (("shared_gate", gate, (256, 512)), ("shared_up", up, (256, 512)), ("shared_down", down, (512, 256)))
    args, has_shared = _shared_expert_args("nvfp4", cpu, *weights)
    assert has_shared and len(args) == 9
    assert args[0] is gate.codes and args[4] is up.block_scales and args[8] is down.tensor_scale
    assert _shared_expert_args("nvfp4", cpu, *((n, None, s) for n, _, s in weights)) == ([None] * 9, False)
    assert _shared_expert_args("bf16", cpu, ("shared_down", None, (512, 256))) == ([None], False)
    with pytest.raises(ValueError, match="all three shared expert weights"):
        _shared_expert_args("nvfp4", cpu, *weights[:2], ("shared_down", None, (512, 256)))
    with pytest.raises(ValueError, match="both shared expert weights"):
        _shared_expert_args("nvfp4", cpu, ("shared_gate", None, (256, 512)), weights[1])
    with pytest.raises(ValueError, match="shared_gate.codes must have shape"):
        _shared_expert_args("nvfp4", cpu, ("shared_gate", gate, (256, 1024)))
