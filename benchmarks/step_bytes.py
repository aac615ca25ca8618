"""The bytes one decode step must read, from the config alone: the floor a step's time is held to.

Weights: attention and norms of every layer, the dense MLPs, the shared expert, the distinct routed
experts the batch selects (expected value under uniform routing), the LM head and the embedding
rows. KV: every full-attention layer reads the whole context of each request; every sliding layer
reads min(context, window) positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from flint_sched.config import FlintConfig

NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16      # 4-bit codes + one E4M3 scale per 16 weights
BF16_BYTES = 2


@dataclass(frozen=True)
class StepBytes:
    weights: float
    kv: float

    @property
    def total(self) -> float:
        return self.weights + self.kv


def expected_distinct_experts(config: FlintConfig, batch: int) -> float:
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def decode_step_bytes(config: FlintConfig, batch: int, context: int, weight_format: str,
                      kv_bytes: int = BF16_BYTES) -> StepBytes:
    """Bytes read by one decode step of `batch` requests that each have `context` tokens (KV
    elements of kv_bytes: 1 for an FP8 cache)."""
    c = config
    per_weight = NVFP4_BYTES_PER_WEIGHT if weight_format == "nvfp4" else BF16_BYTES
    h = c.hidden_size
    attn_linear = h * (c.q_size + 2 * c.kv_size) + c.q_size * h
    attn_small = (2 * h + 2 * c.head_dim + c.num_attention_heads) * BF16_BYTES
    expert = 3 * h * c.moe_intermediate_size
    weights = 0.0
    for i in range(c.num_hidden_layers):
        weights += attn_linear * per_weight + attn_small
        if c.is_moe(i):
            experts = expected_distinct_experts(c, batch) + c.n_shared_experts
            weights += experts * expert * per_weight + c.n_routed_experts * h * BF16_BYTES
        else:
            weights += 3 * h * c.intermediate_size * per_weight
    weights += (c.vocab_size * h + h) * BF16_BYTES + batch * h * BF16_BYTES   # LM head, embedding rows
    kv_per_token_layer = 2 * c.kv_size * kv_bytes
    kv = batch * kv_per_token_layer * (len(c.full_layers) * (context + 1)
                                       + len(c.sliding_layers) * min(context + 1, c.sliding_window))
    return StepBytes(weights, kv)
