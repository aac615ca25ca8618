"""Flint in plain torch: the definition every executor and kernel is checked against (FLINT.md).

One sequence at a time, any dtype (fp32 by default) and device. Weights are a mapping from canonical
names (model/weights.py) to dense tensors or NVFP4Tensor (dequantized when used; routed experts only
for the experts chosen). `KVState` keeps all past K/V of full layers and the last `window - 1` of
sliding layers, so prefill + token-by-token decode equals one full forward.
Shapes: T new tokens, S visible keys, H query heads, G kv heads, D head_dim, E experts, A active.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flint_sched.config import FlintConfig
from flint_sched.quant.fp8 import round_kv
from flint_sched.quant.nvfp4 import NVFP4Tensor

Weight = torch.Tensor | NVFP4Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) * weight, computed in fp32 (the weight multiplies directly)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] for absolute positions; inverse frequency theta^(-2i/D)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on x [T, heads, D]: dimension i pairs with i + D/2."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, None, :], sin[:, None, :]                    # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """softmax over keys with one extra sink logit per head in the denominator (no value).

    q [T, H, D]; k, v [S, G, D]; query head h reads kv head h // (H / G). A key at position j is
    visible to a query at p when j <= p and (window is None or p - j < window).
    Returns [T, H, D].
    """
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                           # [S, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(q.shape[-1])
    visible = k_pos[None, :] <= q_pos[:, None]                      # [T, S]
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    sink = sinks.float().reshape(num_heads, 1, 1).expand(num_heads, q.shape[0], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]   # [H, T, S]
    out = torch.einsum("hts,shd->thd", probs, v.float())
    return out.to(q.dtype)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router in fp32: experts chosen by top-k of (score + bias), weighted by the scores.

    Returns (expert ids [T, A], weights [T, A] fp32 = score / sum(scores of chosen) × scaling).
    """
    scores = torch.sigmoid(x.float() @ gate.float().t())          # [T, E]
    chosen = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    return chosen, weights / weights.sum(dim=-1, keepdim=True) * scaling


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); weights [out, in]."""
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


@dataclass
class LayerKV:
    k: torch.Tensor          # [S, G, D]
    v: torch.Tensor
    positions: torch.Tensor  # [S]


@dataclass
class KVState:
    """Past keys and values of one sequence; `num_tokens` is the next token's position."""

    num_tokens: int = 0
    layers: dict[int, LayerKV] = field(default_factory=dict)


class FlintReference:
    def __init__(self, config: FlintConfig, weights: Mapping[str, Weight],
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | None = None):
        """kv_dtype: attention reads K and V rounded as a KV cache of that type holds them (e4m3:
        quant/fp8.py); None: exact."""
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.device = torch.device(device) if device is not None else _weights_device(weights)

    def w(self, name: str) -> torch.Tensor:
        """A dense weight in the compute dtype (fp32 tensors, the correction bias, stay fp32)."""
        t = self.weights[name]
        if isinstance(t, NVFP4Tensor):
            return t.to(self.device).dequantize(self.dtype)
        return t.to(self.device, torch.float32 if t.dtype == torch.float32 else self.dtype)

    def experts(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Stacked expert weights [len(ids), out, in] of the given experts only."""
        t = self.weights[name]
        if isinstance(t, NVFP4Tensor):
            scale = t.tensor_scale.to(self.device)
            picked = NVFP4Tensor(t.codes.to(self.device)[ids], t.block_scales.to(self.device)[ids],
                                 scale[ids] if scale.numel() > 1 else scale)
            return picked.dequantize(self.dtype)
        return t.to(self.device)[ids].to(self.dtype)

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, state: KVState | None = None,
                hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [T, V] (fp32) for the new tokens; extends `state` when given.

        `hidden_out`, when given, receives each layer's output hidden state [T, hidden].
        """
        state = state if state is not None else KVState()
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        positions = torch.arange(state.num_tokens, state.num_tokens + ids.numel(), device=self.device)
        x = self.w("model.embed_tokens.weight")[ids]                 # [T, hidden]
        for i in range(self.config.num_hidden_layers):
            x = self.layer(i, x, positions, state)
            if hidden_out is not None:
                hidden_out.append(x)
        state.num_tokens += ids.numel()
        x = rms_norm(x, self.w("model.norm.weight"), self.config.rms_norm_eps)
        return (x @ self.w("lm_head.weight").t()).float()

    def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, state: KVState) -> torch.Tensor:
        p, eps = f"model.layers.{i}.", self.config.rms_norm_eps
        h = x + self.attention(i, rms_norm(x, self.w(p + "input_layernorm.weight"), eps), positions, state)
        return h + self.mlp(i, rms_norm(h, self.w(p + "post_attention_layernorm.weight"), eps))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's MoE block, or its dense SwiGLU on the first layers."""
        return self.moe(i, x) if self.config.is_moe(i) else self.dense_mlp(i, x)

    def qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k, v [T, G, D]: projections, Q/K RMSNorm, and RoPE on sliding layers only."""
        c, p = self.config, f"model.layers.{i}.self_attn."
        t = x.shape[0]
        q = (x @ self.w(p + "q_proj.weight").t()).view(t, c.num_attention_heads, c.head_dim)
        k = (x @ self.w(p + "k_proj.weight").t()).view(t, c.num_key_value_heads, c.head_dim)
        v = (x @ self.w(p + "v_proj.weight").t()).view(t, c.num_key_value_heads, c.head_dim)
        q = rms_norm(q, self.w(p + "q_norm.weight"), c.rms_norm_eps)
        k = rms_norm(k, self.w(p + "k_norm.weight"), c.rms_norm_eps)
        if c.is_sliding(i):                                          # full layers: no positions
            q = apply_rope(q, positions, c.rope_theta)
            k = apply_rope(k, positions, c.rope_theta)
        return q, k, v

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, state: KVState) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.self_attn."
        t = x.shape[0]
        q, k, v = self.qkv(i, x, positions)
        k, v = round_kv(k, self.kv_dtype), round_kv(v, self.kv_dtype)
        sliding = c.is_sliding(i)
        past = state.layers.get(i)
        if past is not None:
            k_all, v_all = torch.cat((past.k, k)), torch.cat((past.v, v))
            k_pos = torch.cat((past.positions, positions))
        else:
            k_all, v_all, k_pos = k, v, positions
        window = c.sliding_window if sliding else None
        out = attention_with_sinks(q, k_all, v_all, self.w(p + "sinks"), positions, k_pos, window)
        start = max(0, k_all.shape[0] - (c.sliding_window - 1)) if sliding else 0
        state.layers[i] = LayerKV(k_all[start:], v_all[start:], k_pos[start:])
        return out.reshape(t, c.q_size) @ self.w(p + "o_proj.weight").t()

    def dense_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return swiglu(x, self.w(p + "gate_proj.weight"), self.w(p + "up_proj.weight"),
                      self.w(p + "down_proj.weight"))

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.mlp."
        chosen, weights = route(x, self.w(p + "gate.weight"), self.w(p + "gate.e_score_correction_bias"),
                                c.num_experts_per_tok, c.routed_scaling_factor)
        out = torch.zeros_like(x, dtype=torch.float32)
        used = torch.unique(chosen)
        gate = self.experts(p + "experts.gate_proj.weight", used)     # [U, I, hidden]
        up = self.experts(p + "experts.up_proj.weight", used)
        down = self.experts(p + "experts.down_proj.weight", used)
        for u, expert in enumerate(used.tolist()):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            y = swiglu(x[rows], gate[u], up[u], down[u])
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        if c.n_shared_experts:
            s = p + "shared_experts."
            out += swiglu(x, self.w(s + "gate_proj.weight"), self.w(s + "up_proj.weight"),
                          self.w(s + "down_proj.weight")).float()
        return out.to(x.dtype)


def _weights_device(weights: Mapping[str, Weight]) -> torch.device:
    first = next(iter(weights.values()))
    return first.device
