"""Flint's operations on our kernels (cuda/, launched through cuda-python), for one step's rows.

Three variants of the same operations, chosen per step by the CUDA executor:

    fused     <= 6-8 decode rows: GEMVs and the small-batch MoE that reads only the chosen experts
    grouped   decode batches above that: GEMMs over all rows, the grouped MoE (tokens sorted by
              expert on the GPU, each chosen expert's weights read once per step), batched attention
    prompt    steps with prompt chunks: the grouped GEMMs and MoE, prefill attention over every
              chunk of the step in one launch per layer (kernels/prefill_attention.py), the
              decodes beside them on the decode attention kernel (DECODES_APART)

Decode variants run from CUDA graphs: inputs live in `DecodeInputs` (padded rows: position -1, no
KV write; length 0, zero attention; outside `num_rows`, no expert work), the hidden state stays in
two static buffers, and every launch may use PDL. A layer starts and ends in `hidden[0]`. Prompt
steps of up to graphs.PROMPT_GRAPH_TOKENS rows do too, over `PrefillBuffers` (padding rows: no
KV write, in no attention tile, outside `num_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flint_sched.config import FlintConfig
from flint_sched.executor.dense_copies import DenseCopies
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.step_inputs import DecodeInputs
from flint_sched.kernels import attention as attn
from flint_sched.kernels import decode_step
from flint_sched.kernels.embedding import embed_tokens
from flint_sched.kernels.grouped import grouped_gate_up, grouped_linear
from flint_sched.kernels.grouped_moe import moe_grouped
from flint_sched.kernels.linear import MAX_TOKENS, gate_up_silu, linear, weight_format
from flint_sched.kernels.moe import moe_down, moe_gate_up, moe_split, moe_split_fits, route, router_normalizes
from flint_sched.kernels.norm import add_rms_norm_fixed, rms_norm
from flint_sched.kernels.prefill_attention import (
    PrefillMetadata,
    decode_ring_write,
    prefill_attention,
    prefill_qk_norm_rope,
    prefill_ring_write,
)
from flint_sched.kernels.sampling import greedy

# Grouped and prompt steps normalize the row a residual op writes in the same launch where the
# kernels allow (moe_finalize_norm; the residual epilogue after cuBLAS); False: a launch of its own.
FUSE_NORMS = True

# Grouped and prompt steps of up to this many rows run their dense GEMMs (q/k/v, o_proj, the dense
# MLP, the LM head) on the GEMV kernels over the weights as stored (cuda/gemv.cu: the weights decoded
# once for every 8-row group), by the weight's format; larger steps on cuBLAS over
# bf16 weights (NVFP4: their bf16 copies, executor/dense_copies.py). The fused path always GEMVs.
# Measured on the H200, full model at 1K (benchmarks/ab_decode.py, RESULTS.md session 13), ms a step
# with GEMVs to 16 rows / cuBLAS from 9: NVFP4 at 9 / 12 / 16 requests 4.50 / 4.73 / 4.99 against
# 5.03 / 5.25 / 5.55; BF16 at 16: 8.37 / 8.14 against 8.60 / 8.35 (24 rows: even, so cuBLAS above 16).
# The GEMVs take up to 32 rows (four groups); NVFP4 at 24 / 32 requests with them: 6.16, 6.05 /
# 7.14, 6.81 ms against 6.16, 6.25 / 6.81, 6.77 on cuBLAS (session 14): no gain, so 16.
GEMV_MAX_ROWS = {"nvfp4": 16, "bf16": 16}

# Fused steps: an RMSNorm whose reader is a GEMV (the next layer's q/k/v, the LM head) is done inside
# that GEMV (kernels/linear.py `norm_weight`): a launch and a dependent hop less a layer (the norm
# before the MoE: ROUTER_NORMS). Measured on the H200 (NVFP4, 1K, RESULTS.md session 32), ms a step:
# batch 1 2.32 / 2.18 against 2.33 / 2.33, with ROUTER_NORMS 2.25 / 2.23 against 2.22 / 2.24; batch 4
# and 6 even. No gain beyond the runs' spread: off.
FOLD_NORMS = False

# Fused steps: the norm before the MoE is done by the cluster router (kernels/moe.py `route(...,
# norm_weight=)`), which reads the row unnormalized, normalizes it with the norm kernel's bits and
# writes it out for the experts: a launch and a dependent hop less an MoE layer, the same bits.
# Measured on the H200 (NVFP4, 1K, benchmarks/ab_decode.py, RESULTS.md session 32), ms a step, two
# machines: batch 1 2.33 -> 2.05-2.10 and 2.31 -> 2.22-2.24; batch 4 3.30 -> 3.04-3.15 and 3.30 ->
# 3.24-3.25; batch 6 3.97 -> 3.95-3.96. (The router asking L2 for its chosen experts' gate/up
# weights, tried beside it, lost: 2.33 -> 2.84 at batch 1, 3.3 -> 5.9 at 4.)
ROUTER_NORMS = True

# Steps whose LM head runs on the GEMVs make the greedy choice in the LM head's launch (kernels/linear.py
# `argmax_out`: each CTA's best row of each token by atomicMax, the last CTA writes the ids) instead
# of an argmax launch that reads the logits again: one dependent hop a step fewer, the same ids.
# Off: no gain measured (PDL already overlapped the argmax launch; RESULTS.md session 35).
LM_HEAD_ARGMAX = False

# Fused steps run their layers as one persistent launch (kernels/decode_step.py, cuda/decode_step.cu:
# the kernels' bodies as tasks on counters, no kernel boundaries; the step one graph of a few
# launches: cuda_executor._decode); the LM head stays as it is. The same bits; off: 1.7-1.9x the
# launches' step (one resident CTA a SM runs its tiles one after another). NVFP4, 1K, ms at batch 1 /
# 4: 4.06 / 6.79, with decode_step.EARLY_WEIGHTS 3.85 / 6.68, against 2.19 / 3.22 launched (H100,
# benchmarks/ab_decode.py, RESULTS.md sessions 31 and 36).
PERSISTENT = False
# Fused steps: the attention kernel does the Q/K norms, RoPE and K/V write of its KV head itself
# (kernels/attention.py QKNorm, cuda/decode_attention_qk.cu; the persistent step's FUSE_QK prologue):
# one launch and one dependent hop a layer fewer, the same bits. Measured on the H200 (NVFP4, 1K,
# RESULTS.md session 32), ms a step: batch 1 2.39 / 2.40 against 2.33 / 2.33 (with ROUTER_NORMS
# 2.33 / 2.32 against 2.22 / 2.24), batch 4 3.18 / 3.28 against 3.30 / 3.32: each of the 64
# attention CTAs normalizing its 8 query heads after the wait costs more than the launch. Off.
FUSE_QK_ATTENTION = False

# Fused steps: the MoE's gate/up and down in one launch (kernels/moe.py `moe_split`: each cluster of 8
# CTAs does one expert's 128 intermediate rows and their share of down, summed into a fixed-point
# accumulator by integer atomics: the same bits in any order), the residual added, the sum rounded
# and normalized by the norm launch that follows (kernels/norm.py `add_rms_norm_fixed`, which zeroes
# the accumulator). One dependent hop a MoE layer fewer. NVFP4 experts only (`moe_split_fits`), fused
# steps of at most this many rows (0: never). Measured on an H100 (Flint at 1K, benchmarks/ab_decode.py,
# RESULTS.md session 39), ms a step: batch 1 1.91-1.95 against 2.02-2.08; batch 2 2.42-2.58 against
# 2.34-2.38 (its ~400 CTAs of 256 threads, two a SM, take two waves), 4 3.26-3.30 against 2.95-2.99.
MOE_SPLIT_MAX_ROWS = 1

# Prompt steps: their leading one-row entries (the decodes beside the chunks of a mixed step) attend
# on the decode kernel, the chunks on the prefill kernel (PrefillMetadata.decodes). In the prefill
# kernel a decode is a 16-row query tile with one row, and an e4m3 cache's history goes through its
# slow converting producer: 256 decodes at 1,536 beside a 1,024-row chunk took 25.7 ms of prefill
# attention a step (e4m3; the chunk alone ~2), against 3.4 ms for the decodes on the decode kernel
# (benchmarks/RESULTS.md, session 26). False: every row in the prefill kernel, as before.
DECODES_APART = True


@dataclass(frozen=True)
class Unnormed:
    """rms_norm(h, weight) not computed yet (FOLD_NORMS, ROUTER_NORMS): a GEMV (FOLD_NORMS) or the
    router (ROUTER_NORMS) that reads it normalizes on the fly, any other reader has it computed first
    (`KernelOps._normed`)."""

    h: torch.Tensor
    weight: str


@dataclass
class KernelWeights:
    """What every variant reads: the weights by name (bf16 or NVFP4Tensor on the GPU), q/k/v fused
    per layer (one weight and its row splits), the KV cache, and the static workspaces."""

    config: FlintConfig
    w: dict
    qkv: dict[int, tuple]
    kv: KVCache
    workspaces: object          # executor/workspace.py Workspaces
    pdl: bool = True
    copies: DenseCopies | None = None   # bf16 copies of NVFP4 dense weights (executor/dense_copies.py)


class KernelOps:
    """The operations of executor/forward.py for `rows` rows of one step (see the module docstring).

    hidden: two [rows, hidden] buffers (static for graphs); logits / next_tokens: where the LM head
    and the greedy choice write. `inputs` feeds decode variants; `prefill` (the step's metadata) the
    prompt variant, whose rows are given by `sample_rows` to the LM head; `num_rows` (device int32
    [1], prompt graphs) the real rows of a padded prompt step.
    """

    def __init__(self, weights: KernelWeights, variant: str, rows: int, hidden: torch.Tensor,
                 logits: torch.Tensor, next_tokens: torch.Tensor, inputs: DecodeInputs | None = None,
                 token_ids: torch.Tensor | None = None, prefill: PrefillMetadata | None = None,
                 sample_rows: torch.Tensor | None = None, num_rows: torch.Tensor | None = None,
                 moe_gemms: str | None = None):
        """moe_gemms: the grouped MoE's expert GEMMs (grouped_moe.expert_gemms; None: by row count)."""
        if variant not in ("fused", "grouped", "prompt"):
            raise ValueError(f"unknown variant {variant!r}")
        self.k, self.c, self.w, self.variant, self.rows = weights, weights.config, weights.w, variant, rows
        self.ws = weights.workspaces
        self.hidden = hidden[:, :rows]
        self.logits_out, self.next_tokens = logits, next_tokens
        self.inputs, self.token_ids, self.prefill, self.sample_rows = inputs, token_ids, prefill, sample_rows
        # Rows past this device count are padding (graphs): the MoE gives them no expert work.
        self.num_rows = inputs.num_rows if inputs is not None else num_rows
        self.eps, self.pdl, self.moe_gemms = self.c.rms_norm_eps, weights.pdl, moe_gemms
        self.routing = self.ws.routing_for(rows) if variant != "fused" else None

    def _other(self, h: torch.Tensor | None) -> torch.Tensor:
        """The hidden buffer that `h` is not: where a residual op writes."""
        return self.hidden[1] if h is not None and h.data_ptr() == self.hidden[0].data_ptr() else self.hidden[0]

    # -- the operations ------------------------------------------------------------------------

    def embed(self) -> torch.Tensor:
        """The step's first kernel: the embedding rows, and for a decode step its placeholder tokens
        and new block-table entries (DecodeInputs)."""
        h, table = self.hidden[0], self.w["model.embed_tokens.weight"]
        if self.inputs is None:
            return embed_tokens(table, self.token_ids, h, pdl=self.pdl)
        inp = self.inputs
        return embed_tokens(table, inp.tokens, h, sources=inp.sources, sampled=inp.sampled,
                            table_scatter=inp.table_scatter, pdl=self.pdl)

    def resume(self) -> torch.Tensor:
        return self.hidden[0]

    def layers(self, first: int, last: int) -> torch.Tensor | None:
        """A fused step's layers [first, last) in one launch (PERSISTENT), in place in hidden[0]."""
        if not (PERSISTENT and self.variant == "fused"):
            return None
        kv, h = self.k.kv, self.hidden[0]
        key = (self.rows, first, last, decode_step.FOLD_NORMS, decode_step.FUSE_QK, decode_step.WARPS,
               decode_step.EARLY_WEIGHTS, decode_step.SMS, h.data_ptr(),
               kv.full.data_ptr(), kv.ring.data_ptr(), self.inputs.flat.data_ptr(), self.ws.attention.data_ptr(),
               self.ws.router.data_ptr())
        step = self.ws.decode_steps.get(key)
        if step is None:       # built outside a capture (the graphs' eager first run): static tables
            fits = decode_step.supported(self.c, self.w, self.k.qkv, self.rows) is None
            step = decode_step.DecodeStep(self.k, self.inputs, h, self.rows, first, last) if fits else False
            self.ws.decode_steps[key] = step
        if step is False:      # a model the persistent step does not take (mixed weight formats): launches
            return None
        step.launch(pdl=self.pdl)
        return h

    def rms_norm(self, x: torch.Tensor, weight: str) -> torch.Tensor | Unnormed:
        if (FOLD_NORMS or ROUTER_NORMS) and self.variant == "fused":
            return Unnormed(x, weight)
        return rms_norm(x, self.w[weight], self.eps, out=torch.empty_like(x), pdl=self.pdl)

    def _normed(self, x: torch.Tensor | Unnormed) -> torch.Tensor:
        """x, or the norm an Unnormed stands for, launched now."""
        if isinstance(x, Unnormed):
            return rms_norm(x.h, self.w[x.weight], self.eps, out=torch.empty_like(x.h), pdl=self.pdl)
        return x

    def _gemv_linear(self, x: torch.Tensor | Unnormed, weight, **kw) -> torch.Tensor:
        """`linear` of x, folding the norm of an Unnormed into it (FOLD_NORMS)."""
        if isinstance(x, Unnormed) and FOLD_NORMS:
            return linear(x.h, weight, pdl=self.pdl, norm_weight=self.w[x.weight], norm_eps=self.eps, **kw)
        return linear(self._normed(x), weight, pdl=self.pdl, **kw)

    def qkv(self, i: int, x: torch.Tensor | Unnormed):
        c, p = self.c, f"model.layers.{i}.self_attn."
        weight, splits = self.k.qkv[i]
        out = torch.empty(self.rows, c.q_size + 2 * c.kv_size, dtype=torch.bfloat16, device=self.hidden.device)
        if self._gemv(self.rows, weight):
            qkv = self._gemv_linear(x, weight, out=out, row_splits=splits)
        else:
            x = self._normed(x)
            if self.k.copies is not None:
                weight, splits = self.k.copies.qkv_weight(i, self.rows, weight, splits)
            qkv = grouped_linear(x, weight, out=out, pdl=self.pdl, row_splits=splits)
        if self.variant == "prompt":       # in place; full layers write the chunk's K/V to their blocks now
            kv, sliding = self.k.kv, c.is_sliding(i)
            pools = () if sliding else tuple(kv.full[kv.full_index[i]])
            return prefill_qk_norm_rope(qkv, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"], self.prefill,
                                        c.rms_norm_eps, c.rope_theta if sliding else None, *pools, pdl=self.pdl)
        if FUSE_QK_ATTENTION and self.variant == "fused":
            return attn.QKNorm(qkv, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"],
                               self.inputs.positions[:self.rows], c.rms_norm_eps,
                               c.rope_theta if c.is_sliding(i) else None,
                               self.ws.q_slots(MAX_TOKENS, self.inputs.max_model_len))
        inp, q = self.inputs, torch.empty(self.rows, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16,
                                          device=qkv.device)
        b = self.rows
        if c.is_sliding(i):
            ring = self.k.kv.ring[self.k.kv.ring_index[i]]
            return attn.qk_norm_rope_kv_sliding(qkv, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"],
                                                inp.positions[:b], ring[0], ring[1], inp.ring_slots[:b], c.rms_norm_eps,
                                                c.rope_theta, q_out=q, pdl=self.pdl)
        full = self.k.kv.full[self.k.kv.full_index[i]]
        return attn.qk_norm_rope_kv_full(qkv, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"],
                                         inp.positions[:b], full[0], full[1], inp.block_tables[:b], c.rms_norm_eps,
                                         q_out=q, pdl=self.pdl)

    def attention(self, i: int, q) -> torch.Tensor:
        c, b = self.c, self.rows
        if self.variant == "prompt":
            return self._prefill_attention(i, q)
        inp, sinks = self.inputs, self.w[f"model.layers.{i}.self_attn.sinks"]
        out = torch.empty(b, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16, device=self.hidden.device)
        if c.is_sliding(i):
            ring = self.k.kv.ring[self.k.kv.ring_index[i]]
            attn.decode_attention_sliding(q, ring[0], ring[1], inp.ring_slots[:b], inp.seq_lens[:b], sinks,
                                          self.ws.attention, out=out, pdl=self.pdl, window=c.sliding_window)
        else:
            full = self.k.kv.full[self.k.kv.full_index[i]]
            attn.decode_attention_full(q, full[0], full[1], inp.block_tables[:b], inp.seq_lens[:b], sinks,
                                       self.ws.attention, inp.max_model_len, out=out, pdl=self.pdl)
        return out.view(b, c.q_size)

    def _prefill_attention(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        """Sliding layers read the ring's history first and write the chunk's last keys after. The
        decodes apart (DECODES_APART) attend first, from their q/k/v rows, into the same output rows
        (a sliding layer's decodes put their new key in the ring before)."""
        c, meta = self.c, self.prefill
        kv, sliding, sinks = self.k.kv, c.is_sliding(i), self.w[f"model.layers.{i}.self_attn.sinks"]
        pools = kv.ring[kv.ring_index[i]] if sliding else kv.full[kv.full_index[i]]
        out = torch.empty(self.rows, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16, device=qkv.device)
        if d := meta.num_decodes:
            q = qkv[:d, :c.q_size].view(d, c.num_attention_heads, c.head_dim)
            lens, slots = meta.decodes[0], meta.decodes[1]
            if sliding:
                decode_ring_write(qkv, pools[0], pools[1], meta, pdl=self.pdl)
                attn.decode_attention_sliding(q, pools[0], pools[1], slots, lens, sinks, self.ws.attention,
                                              out=out[:d], pdl=self.pdl, window=c.sliding_window)
            else:
                attn.decode_attention_full(q, pools[0], pools[1], meta.block_tables[:d], lens, sinks,
                                           self.ws.attention, meta.decode_max_len, out=out[:d], pdl=self.pdl)
        out = prefill_attention(qkv, pools[0], pools[1], meta, sinks, sliding, out=out, pdl=self.pdl)
        if sliding:
            prefill_ring_write(qkv, pools[0], pools[1], meta, pdl=self.pdl)
        return out.view(self.rows, c.q_size)

    def _gemv(self, rows: int, weight) -> bool:
        """Whether a dense GEMM of `rows` rows over `weight` runs on the GEMV kernels."""
        return self.variant == "fused" or rows <= GEMV_MAX_ROWS[weight_format(weight)]

    def _weight(self, name: str, rows: int):
        """The weight a grouped GEMM of `rows` rows reads: its bf16 copy where cuBLAS serves it."""
        w = self.w[name]
        return w if self.k.copies is None else self.k.copies.weight(name, rows, w)

    def _dense(self, x: torch.Tensor | Unnormed, name: str, out: torch.Tensor,
               residual: torch.Tensor | None = None):
        """x @ W^T (+ residual) into out, on the GEMVs or the grouped GEMMs by the rows (`_gemv`)."""
        rows, w = out.shape[0], self.w[name]
        if self._gemv(rows, w):
            return self._gemv_linear(x, w, residual=residual, out=out)
        return grouped_linear(self._normed(x), self._weight(name, rows), residual=residual, out=out, pdl=self.pdl)

    def linear(self, x: torch.Tensor, weight: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._dense(x, weight, self._other(residual), residual)

    def linear_norm(self, x: torch.Tensor, weight: str, residual: torch.Tensor, norm: str | None):
        if norm is None or self._gemv(x.shape[0], self.w[weight]) or not FUSE_NORMS:
            h = self.linear(x, weight, residual)
            return h, None if norm is None else self.rms_norm(h, norm)
        normed = torch.empty_like(residual)
        h = grouped_linear(x, self._weight(weight, x.shape[0]), residual=residual, out=self._other(residual),
                           pdl=self.pdl, norm_weight=self.w[norm], norm_out=normed, norm_eps=self.eps)
        return h, normed

    def gate_up(self, x: torch.Tensor | Unnormed, gate: str, up: str) -> torch.Tensor:
        x = self._normed(x)
        rows = x.shape[0]
        out = torch.empty(rows, self.w[gate].shape[0], dtype=torch.bfloat16, device=x.device)
        if self._gemv(rows, self.w[gate]):
            return gate_up_silu(x, self.w[gate], self.w[up], out=out, pdl=self.pdl)
        return grouped_gate_up(x, self._weight(gate, rows), self._weight(up, rows), out=out, pdl=self.pdl)

    def moe(self, i: int, x: torch.Tensor | Unnormed, residual: torch.Tensor, norm: str | None = None):
        c, w, p = self.c, self.w, f"model.layers.{i}.mlp."
        router, bias = w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"]
        experts, shared = self._experts(i)
        out = self._other(residual)
        if self.variant == "fused":
            if self._router_norms(x, router):
                normed = torch.empty_like(x.h)
                ids, weights = route(x.h, router, bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                     pdl=self.pdl, norm_weight=w[x.weight], norm_eps=self.eps, normed=normed)
                x = normed
            else:
                x = self._normed(x)
                ids, weights = route(x, router, bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                     pdl=self.pdl, workspace=self.ws.router)
            fmt = weight_format(*experts)
            if self.rows <= MOE_SPLIT_MAX_ROWS and moe_split_fits(fmt, c.hidden_size, c.moe_intermediate_size, self.rows):
                acc = self.ws.moe_acc[: self.rows]          # zeros; the norm below leaves it so
                moe_split(x, ids, weights, *experts, *shared, acc=acc, pdl=self.pdl)
                normed = torch.empty_like(residual)
                add_rms_norm_fixed(acc, residual, w[norm or "model.norm.weight"], self.eps, out=normed,
                                   residual_out=out, pdl=self.pdl)
                return out, None if norm is None else normed
            hidden = torch.empty(self.rows, c.num_experts_per_tok + 1, c.moe_intermediate_size,
                                 dtype=torch.bfloat16, device=x.device)
            hidden = moe_gate_up(x, ids, experts[0], experts[1], shared[0], shared[1], out=hidden, pdl=self.pdl)
            h = moe_down(hidden, ids, weights, experts[2], shared[2], residual=residual, out=out, pdl=self.pdl)
            return h, None if norm is None else self.rms_norm(h, norm)
        x = self._normed(x)
        fuse = norm is not None and FUSE_NORMS
        normed = torch.empty_like(residual) if fuse else None
        h = moe_grouped(x, router, bias, c.num_experts_per_tok, c.routed_scaling_factor, *experts, *shared,
                        residual=residual, workspace=self.routing, out=out, num_tokens=self.num_rows,
                        pdl=self.pdl, gemms=self.moe_gemms, norm_weight=w[norm] if fuse else None,
                        norm_out=normed, norm_eps=self.eps)
        if norm is not None and not fuse:
            normed = self.rms_norm(h, norm)
        return h, normed

    def _experts(self, i: int) -> tuple[list, list]:
        """Layer i's stacked expert weights and its shared expert's (None without one): gate, up, down."""
        c, w, p = self.c, self.w, f"model.layers.{i}.mlp."
        names = ("gate", "up", "down")
        return ([w[p + f"experts.{n}_proj.weight"] for n in names],
                [w[p + f"shared_experts.{n}_proj.weight"] if c.n_shared_experts else None for n in names])

    def _router_norms(self, x: torch.Tensor | Unnormed, router: torch.Tensor) -> bool:
        """Whether the router normalizes x itself (ROUTER_NORMS, on the cluster router only)."""
        return isinstance(x, Unnormed) and ROUTER_NORMS and router_normalizes(*router.shape, self.rows)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.sample_rows is not None:
            h = h.index_select(0, self.sample_rows)
        rows = h.shape[0]
        if rows == 0:
            return self.logits_out[:0]
        normed = self.rms_norm(h, "model.norm.weight")
        active = None if self.inputs is None else self.inputs.argmax
        w = self.w["lm_head.weight"]
        if LM_HEAD_ARGMAX and self._gemv(rows, w):
            return linear(self._normed(normed), w, out=self.logits_out[:rows], pdl=self.pdl,
                          argmax_out=self.next_tokens[:rows],
                          argmax_workspace=self.ws.pick, argmax_active=active)
        logits = self._dense(normed, "lm_head.weight", self.logits_out[:rows])
        greedy(logits, out=self.next_tokens[:rows], workspace=self.ws.argmax, pdl=self.pdl, active=active)
        return logits
