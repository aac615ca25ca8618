"""FlintConfig <-> GGUF metadata under `flint.*` (FLINT.md, "NVFP4 (one GGUF file)")."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from flint_sched.config import FULL, SLIDING, ConfigError, FlintConfig

ARCH = "flint"
GATING_SIGMOID = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid


def write_gguf_config(writer: gguf.GGUFWriter, c: FlintConfig) -> None:
    a = ARCH
    writer.add_uint32(f"{a}.block_count", c.num_hidden_layers)
    writer.add_uint32(f"{a}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{a}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{a}.expert_feed_forward_length", c.moe_intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", c.num_key_value_heads)
    writer.add_uint32(f"{a}.attention.key_length", c.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", c.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_uint32(f"{a}.attention.sliding_window", c.sliding_window)
    writer.add_array(f"{a}.attention.sliding_window_pattern", [t == SLIDING for t in c.layer_types])
    writer.add_float32(f"{a}.rope.freq_base", c.rope_theta)
    writer.add_uint32(f"{a}.expert_count", c.n_routed_experts)
    writer.add_uint32(f"{a}.expert_used_count", c.num_experts_per_tok)
    writer.add_uint32(f"{a}.expert_shared_count", c.n_shared_experts)
    writer.add_float32(f"{a}.expert_weights_scale", c.routed_scaling_factor)
    writer.add_bool(f"{a}.expert_weights_norm", c.norm_topk_prob)
    writer.add_uint32(f"{a}.expert_gating_func", GATING_SIGMOID)
    writer.add_uint32(f"{a}.leading_dense_block_count", c.first_k_dense_replace)
    writer.add_uint32(f"{a}.vocab_size", c.vocab_size)


def gguf_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.") and not name.startswith("GGUF.")}


def config_from_gguf_fields(fields: dict[str, Any]) -> FlintConfig:
    """Build the config from metadata values; a missing or wrong key is named in the error."""
    arch = fields.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"general.architecture is {arch!r}, expected {ARCH!r}")

    def get(key: str) -> Any:
        try:
            return fields[f"{ARCH}.{key}"]
        except KeyError:
            raise ConfigError(f"GGUF metadata is missing {ARCH}.{key}") from None

    pattern = get("attention.sliding_window_pattern")
    if get("expert_gating_func") != GATING_SIGMOID:
        raise ConfigError(f"{ARCH}.expert_gating_func is {get('expert_gating_func')}, expected sigmoid (2)")
    if get("attention.key_length") != get("attention.value_length"):
        raise ConfigError(f"{ARCH}.attention.key_length and value_length differ")
    return FlintConfig(
        hidden_size=int(get("embedding_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=int(get("attention.key_length")),
        layer_types=tuple(SLIDING if s else FULL for s in pattern),
        sliding_window=int(get("attention.sliding_window")),
        intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        n_routed_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        vocab_size=int(get("vocab_size")),
        n_shared_experts=int(get("expert_shared_count")),
        first_k_dense_replace=int(get("leading_dense_block_count")),
        routed_scaling_factor=_f32(get("expert_weights_scale")),
        norm_topk_prob=bool(get("expert_weights_norm")),
        rope_theta=_f32(get("rope.freq_base")),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
    )


def _f32(value: Any) -> float:
    """The shortest decimal that rounds to this float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))
