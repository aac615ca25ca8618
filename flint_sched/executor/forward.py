"""The forward pass, written once: Flint's layer loop over a few operations (FLINT.md).

Executors run a step by handing `forward` an implementation of these operations for the step's
rows: torch ops (executor/torch_ops.py, any device) or our kernels (executor/kernel_ops.py: the
fused path for <= 6-8 decodes, the grouped path for larger batches and prompt chunks). The loop is
the model; the ops decide how each piece runs. model/reference.py stays the oracle, apart.

    h = embed(tokens)
    for layer i:                                          pre-norm residual blocks
        q = qkv(i, rms_norm(h))                           projections, Q/K norm, RoPE, K/V write
        h = linear(attention(i, q), o_proj, residual=h)
        x = rms_norm(h)
        h = moe(i, x, residual=h)                         or linear(gate_up(x), down, residual=h)
    logits = lm_head(rms_norm(h))                         rows that sample only

Ops that run a range of layers in one go (the persistent decode step, kernels/decode_step.py) say
so through `layers`, and the loop is skipped; the model is still this loop, done inside one launch.

A residual op also takes the RMSNorm that follows it (`norm`: the next input or post-attention
norm's weight) and returns (h, rms_norm(h)), so the kernels can normalize the row they just wrote
in the same pass; the first layer of a call and the LM head's rows normalize on their own.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from flint_sched.config import FlintConfig


class LayerOps(Protocol):
    """One step's implementation of the model's operations; weights are named as in weights.py."""

    def embed(self) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens."""

    def resume(self) -> torch.Tensor:
        """The hidden state where an earlier `forward(..., last=k)` of this step stopped."""

    def layers(self, first: int, last: int) -> torch.Tensor | None:
        """Layers [first, last) in one go from the hidden state embed/resume returned (the
        persistent decode step: kernels/decode_step.py), returning the new hidden state; None where
        the ops run a layer an operation at a time (the loop below)."""

    def rms_norm(self, x: torch.Tensor, weight: str) -> torch.Tensor: ...

    def qkv(self, i: int, x: torch.Tensor) -> Any:
        """Layer i's q/k/v projection, Q/K RMSNorm, RoPE (sliding layers) and the K/V write (the
        write may be deferred into `attention`); returns what `attention` reads."""

    def attention(self, i: int, qkv: Any) -> torch.Tensor:
        """Attention with sinks over the layer's KV: [T, heads * head_dim]."""

    def linear(self, x: torch.Tensor, weight: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ residual)."""

    def linear_norm(self, x: torch.Tensor, weight: str, residual: torch.Tensor,
                    norm: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h, rms_norm(h, norm)) with h = x @ W^T + residual; (h, None) without a norm."""

    def gate_up(self, x: torch.Tensor, gate: str, up: str) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T): the dense SwiGLU's front half."""

    def moe(self, i: int, x: torch.Tensor, residual: torch.Tensor,
            norm: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h, rms_norm(h, norm) or None), h = residual + the layer's routed experts (router,
        top-k, weighted sum) + shared expert."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head of the rows that sample: [rows, vocab]."""


def _in_one_go(ops: LayerOps, first: int, last: int, layer_outputs: list[torch.Tensor] | None) -> torch.Tensor | None:
    """ops.layers over [first, last), or None where the ops run layers an operation at a time. With
    layer_outputs, a call a layer, each output kept (the per-layer checks of a persistent step)."""
    if layer_outputs is None:
        return ops.layers(first, last)
    h = None
    for i in range(first, last):
        if (h := ops.layers(i, i + 1)) is None:
            return None                      # the ops say so at the first layer or never
        layer_outputs.append(h.clone())
    return h


def forward(ops: LayerOps, config: FlintConfig, first: int = 0, last: int | None = None,
            layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Layers [first, last) of one step: from the embedding when first == 0, through the LM head
    (the logits are returned) when last is the final layer, else the hidden state.

    `layer_outputs`, when given, receives a copy of each layer's output hidden state.
    """
    last = config.num_hidden_layers if last is None else last
    h = ops.embed() if first == 0 else ops.resume()
    if (done := _in_one_go(ops, first, last, layer_outputs)) is not None:
        return done if last < config.num_hidden_layers else ops.logits(done)
    x = ops.rms_norm(h, f"model.layers.{first}.input_layernorm.weight") if first < last else None
    for i in range(first, last):
        p = f"model.layers.{i}."
        q = ops.qkv(i, x)
        h, x = ops.linear_norm(ops.attention(i, q), p + "self_attn.o_proj.weight", h,
                               p + "post_attention_layernorm.weight")
        after = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < last else None
        if config.is_moe(i):
            h, x = ops.moe(i, x, h, after)
        else:
            up = ops.gate_up(x, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            h, x = ops.linear_norm(up, p + "mlp.down_proj.weight", h, after)
        if layer_outputs is not None:
            layer_outputs.append(h.clone())
    if last < config.num_hidden_layers:
        return h
    return ops.logits(h)
