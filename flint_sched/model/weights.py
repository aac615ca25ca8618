"""Every tensor of a Flint checkpoint: canonical name, shape, GGUF name, and whether NVFP4 quantizes it.

Canonical names are the Hugging Face names, except that routed experts are stacked:
`model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight` is [E, out, in] (HF files hold one tensor per
expert, `mlp.experts.{e}.…`; GGUF holds them stacked as `blk.{i}.ffn_*_exps.weight`).
A loaded model is a `dict[str, torch.Tensor | NVFP4Tensor]` keyed by canonical name.
"""

from __future__ import annotations

from dataclasses import dataclass

from flint_sched.config import FlintConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str               # canonical (HF-style, experts stacked)
    shape: tuple[int, ...]
    gguf_name: str
    quantized: bool         # NVFP4 in the GGUF; bf16 otherwise (fp32 for the correction bias)
    role: str               # what kind of weight, for random initialization
    fp32: bool = False      # kept in fp32 in both formats

    @property
    def stacked_experts(self) -> bool:
        return ".mlp.experts." in self.name

    @property
    def fan_in(self) -> int:
        return self.shape[-1]


def tensor_specs(config: FlintConfig) -> list[TensorSpec]:
    """All tensors in file order: embedding, then each layer, then the final norm and LM head."""
    c = config
    h, v = c.hidden_size, c.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), "token_embd.weight", False, "embedding")]
    for i in range(c.num_hidden_layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."

        def add(name: str, shape: tuple[int, ...], gguf: str, quantized: bool, role: str,
                fp32: bool = False) -> None:
            specs.append(TensorSpec(p + name, shape, g + gguf, quantized, role, fp32))

        add("input_layernorm.weight", (h,), "attn_norm.weight", False, "norm")
        add("self_attn.q_proj.weight", (c.q_size, h), "attn_q.weight", True, "linear")
        add("self_attn.k_proj.weight", (c.kv_size, h), "attn_k.weight", True, "linear")
        add("self_attn.v_proj.weight", (c.kv_size, h), "attn_v.weight", True, "linear")
        add("self_attn.o_proj.weight", (h, c.q_size), "attn_output.weight", True, "residual_out")
        add("self_attn.q_norm.weight", (c.head_dim,), "attn_q_norm.weight", False, "norm")
        add("self_attn.k_norm.weight", (c.head_dim,), "attn_k_norm.weight", False, "norm")
        add("self_attn.sinks", (c.num_attention_heads,), "attn_sinks.weight", False, "sink")
        add("post_attention_layernorm.weight", (h,), "ffn_norm.weight", False, "norm")
        if not c.is_moe(i):
            n = c.intermediate_size
            add("mlp.gate_proj.weight", (n, h), "ffn_gate.weight", True, "linear")
            add("mlp.up_proj.weight", (n, h), "ffn_up.weight", True, "linear")
            add("mlp.down_proj.weight", (h, n), "ffn_down.weight", True, "residual_out")
            continue
        e, n = c.n_routed_experts, c.moe_intermediate_size
        add("mlp.gate.weight", (e, h), "ffn_gate_inp.weight", False, "router")
        add("mlp.gate.e_score_correction_bias", (e,), "exp_probs_b.bias", False, "router_bias", True)
        add("mlp.experts.gate_proj.weight", (e, n, h), "ffn_gate_exps.weight", True, "linear")
        add("mlp.experts.up_proj.weight", (e, n, h), "ffn_up_exps.weight", True, "linear")
        add("mlp.experts.down_proj.weight", (e, h, n), "ffn_down_exps.weight", True, "residual_out")
        if c.n_shared_experts:
            add("mlp.shared_experts.gate_proj.weight", (n, h), "ffn_gate_shexp.weight", True, "linear")
            add("mlp.shared_experts.up_proj.weight", (n, h), "ffn_up_shexp.weight", True, "linear")
            add("mlp.shared_experts.down_proj.weight", (h, n), "ffn_down_shexp.weight", True,
                "residual_out")
    specs.append(TensorSpec("model.norm.weight", (h,), "output_norm.weight", False, "norm"))
    specs.append(TensorSpec("lm_head.weight", (v, h), "output.weight", False, "linear"))
    return specs


def gguf_scale_name(gguf_weight_name: str) -> str:
    """The llama.cpp sidecar holding the FP32 tensor scale of a quantized weight."""
    return gguf_weight_name.removesuffix(".weight") + ".scale"


def hf_expert_name(stacked_name: str, expert: int) -> str:
    """`…mlp.experts.gate_proj.weight` -> `…mlp.experts.{expert}.gate_proj.weight`."""
    head, tail = stacked_name.split(".mlp.experts.")
    return f"{head}.mlp.experts.{expert}.{tail}"


def check_nvfp4_shapes(config: FlintConfig) -> None:
    """NVFP4 needs every quantized weight's input size to be a multiple of 64."""
    for spec in tensor_specs(config):
        if spec.quantized and spec.fan_in % 64:
            raise ValueError(f"{spec.name}: input size {spec.fan_in} is not a multiple of 64, "
                             "which NVFP4 (GGML type 40) requires")
