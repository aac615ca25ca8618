"""FlintConfig: the model's shape, built from a Hugging Face config.json, GGUF metadata or a preset.

A frozen dataclass validated when built; field names follow Hugging Face's `config.json`.
Constructing one never reads a file: `from_hf_dict` / `from_gguf_fields` take parsed data, and
`load_hf_config` / `preset` do the reading.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
PRESETS = ("flint", "flint-tiny")


class ConfigError(ValueError):
    """A config that cannot describe a Flint model; the message names the field."""


@dataclass(frozen=True)
class FlintConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    vocab_size: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    model_type: str = "flint"
    architectures: tuple[str, ...] = ("FlintForCausalLM",)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "architectures", tuple(self.architectures))
        self._validate()

    def _validate(self) -> None:
        positive = (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
            "num_experts_per_tok", "vocab_size", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] is {kind!r}, expected one of {LAYER_TYPES}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be an integer >= 1, got {self.sliding_window!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"n_routed_experts ({self.n_routed_experts})")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace must be in [0, num_hidden_layers], "
                f"got {self.first_k_dense_replace}")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func must be 'sigmoid', got {self.scoring_func!r}")
        if not self.norm_topk_prob:
            raise ConfigError("norm_topk_prob must be true: Flint normalizes the top-k weights")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings must be false: Flint has an untied LM head")
        for name in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")

    # -- derived shapes ------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters; active includes the LM head, not the embedding."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attn = h * (q + 2 * kv) + q * h + 2 * self.head_dim + self.num_attention_heads + 2 * h
        dense = 3 * h * self.intermediate_size
        expert = 3 * h * self.moe_intermediate_size
        router = self.n_routed_experts * h + self.n_routed_experts
        total = active = 0
        for i in range(self.num_hidden_layers):
            if self.is_moe(i):
                shared = self.n_shared_experts * expert
                total += attn + router + shared + self.n_routed_experts * expert
                active += attn + router + shared + self.num_experts_per_tok * expert
            else:
                total += attn + dense
                active += attn + dense
        head = self.vocab_size * h + h
        return total + head + self.vocab_size * h, active + head

    # -- conversions ---------------------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["layer_types"] = list(self.layer_types)
        out["architectures"] = list(self.architectures)
        return {**self.extra, **out}

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> FlintConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ConfigError(f"config is missing field(s): {', '.join(missing)}")
        if data.get("model_type", "flint") != "flint":
            raise ConfigError(f"model_type is {data['model_type']!r}, expected 'flint'")
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)


def load_hf_config(path: str | Path) -> FlintConfig:
    """Read a `config.json` (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    try:
        return FlintConfig.from_hf_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def preset(name: str) -> FlintConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    text = resources.files("flint_sched").joinpath("presets", f"{name}.json").read_text()
    return FlintConfig.from_hf_dict(json.loads(text))


def flint_layer_types(num_layers: int) -> list[str]:
    """Flint's pattern: layer i is full attention when i % 7 is 3 or 6."""
    return [FULL if i % 7 in (3, 6) else SLIDING for i in range(num_layers)]
