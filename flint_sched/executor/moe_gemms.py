"""The expert GEMMs a step of the CUDA executor takes, by its rows and the experts' weights: the
hybrid ones (kernels/grouped_moe.py) for mixed steps of enough rows, grouped_moe's choice by row
count otherwise."""

from __future__ import annotations

from flint_sched.config import FlintConfig
from flint_sched.kernels.grouped_moe import expert_gemms
from flint_sched.kernels.linear import weight_format

# Mixed steps (prompt chunks beside decodes) of at least this many rows run the hybrid expert GEMMs
# (kernels/grouped_moe.py: experts of many rows tiled, the rest on the decode GEMMs): the decode
# rows' experts the prompts do not touch leave the 128-row tiles. Full model, NVFP4, 1,536 tokens of
# context (RESULTS.md, session 19): 64-256 decodes + 512-1,024 prompt rows -10 to -16 %, 256 + 7,936
# -2.7 % (session 18); a prompt alone loses with them (+2-16 %) and keeps the tiled GEMMs. 0: never.
HYBRID_MIXED_MIN_ROWS = 512


def expert_format(config: FlintConfig, w: dict) -> str | None:
    """"nvfp4" or "bf16": the routed experts' weights (None: no MoE layer)."""
    moe = next((i for i in range(config.num_hidden_layers) if config.is_moe(i)), None)
    if moe is None:
        return None
    return weight_format(w[f"model.layers.{moe}.mlp.experts.gate_proj.weight"])


def hybrid_available(config: FlintConfig, w: dict) -> bool:
    """Whether the model's experts fit both kinds of expert GEMMs (NVFP4 at the kernels' shapes)."""
    fmt = expert_format(config, w)
    return fmt is not None and expert_gemms(1, fmt, config.hidden_size, config.moe_intermediate_size,
                                            "hybrid") == "hybrid"


def hybrid_rows(rows: int, available: bool) -> bool:
    """Whether a mixed step of `rows` rows takes the hybrid expert GEMMs (weights allowing)."""
    return available and 0 < HYBRID_MIXED_MIN_ROWS <= rows


def mixed_moe_gemms(entries: list, rows: int, available: bool) -> str | None:
    """The expert GEMMs of a prompt-variant step: "hybrid" for a mixed step (a prompt chunk beside
    at least one decode) of at least HYBRID_MIXED_MIN_ROWS rows where the weights allow it, else
    None (grouped_moe's choice by row count)."""
    if not hybrid_rows(rows, available):
        return None
    decode = [e.num_tokens == 1 and e.samples for e in entries]
    return "hybrid" if any(decode) and not all(decode) else None
