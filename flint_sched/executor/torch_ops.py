"""Flint's operations in plain torch over the paged KV layout, for the rows of one step (any device).

The rows are the step's entries one after another (a prefill chunk's tokens, or one token per
decode). Projections, norms and MLPs run on all rows together; attention runs per request,
reading its block table (full layers) or its ring slot (sliding layers). The model math comes from
model/reference.py (`FlintReference` holds the weights in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flint_sched.core.plan import ScheduledRequest
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.prompt_logprobs import prompt_rows, prompt_spans
from flint_sched.model.reference import FlintReference, apply_rope, attention_with_sinks, rms_norm

QUERY_BLOCK = 256   # query rows per attention call on full layers: scores are [heads, rows, context]


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                      q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """attention_with_sinks over QUERY_BLOCK query rows at a time (long prefill chunks)."""
    if q.shape[0] <= QUERY_BLOCK:
        return attention_with_sinks(q, k, v, sinks, q_pos, k_pos, window)
    return torch.cat([attention_with_sinks(q[a:a + QUERY_BLOCK], k, v, sinks, q_pos[a:a + QUERY_BLOCK], k_pos, window)
                      for a in range(0, q.shape[0], QUERY_BLOCK)])


@dataclass
class StepRows:
    """The step's rows as tensors: token ids, absolute positions, and per entry its block table;
    `sample_rows`: the last row of each entry that samples; `logit_rows`: the rows whose logits are
    needed, those then the prompt-logprob rows of `prompt_spans` (executor/prompt_logprobs.py)."""

    entries: list[ScheduledRequest]
    token_ids: torch.Tensor
    positions: torch.Tensor
    tables: list[torch.Tensor]
    sample_rows: torch.Tensor
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    logit_rows: torch.Tensor | None = None

    @classmethod
    def from_entries(cls, entries: list[ScheduledRequest], device: torch.device) -> StepRows:
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(e.start_position, e.end_position) for e in entries]).to(device)
        tables = [torch.tensor(e.block_table, dtype=torch.long, device=device) for e in entries]
        ends, rows = 0, []
        for e in entries:
            ends += e.num_tokens
            if e.samples:
                rows.append(ends - 1)
        spans = prompt_spans(entries)
        sample_rows = torch.tensor(rows, dtype=torch.long, device=device)
        logit_rows = torch.tensor(rows + prompt_rows(spans), dtype=torch.long, device=device) if spans else sample_rows
        return cls(entries, ids, positions, tables, sample_rows, spans, logit_rows)


class AttentionOps:
    """Q/K norm, RoPE, the K/V write and attention in torch: TorchOps' attention half (the CUDA
    executor's prompt steps run kernels/prefill_attention.py instead)."""

    def __init__(self, model: FlintReference, kv: KVCache, rows: StepRows):
        self.model, self.config, self.kv, self.rows = model, model.config, kv, rows

    def norm_rope(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [T, H, D], k, v [T, G, D]: per-head RMSNorm of q and k, RoPE on sliding layers."""
        c, m, p = self.config, self.model, f"model.layers.{i}.self_attn."
        q = rms_norm(q, m.w(p + "q_norm.weight"), c.rms_norm_eps)
        k = rms_norm(k, m.w(p + "k_norm.weight"), c.rms_norm_eps)
        if c.is_sliding(i):                                          # full layers: no positions
            q = apply_rope(q, self.rows.positions, c.rope_theta)
            k = apply_rope(k, self.rows.positions, c.rope_theta)
        return q, k, v

    def attention(self, i: int, qkv) -> torch.Tensor:
        c, q, (k, v) = self.config, qkv[0], qkv[1:]
        sinks = self.model.w(f"model.layers.{i}.self_attn.sinks")
        out = torch.empty_like(q)
        start = 0
        for entry, table in zip(self.rows.entries, self.rows.tables, strict=True):
            rows = slice(start, start + entry.num_tokens)
            start += entry.num_tokens
            pos = self.rows.positions[rows]
            if c.is_sliding(i):
                out[rows] = self._sliding(i, entry, pos, q[rows], k[rows], v[rows], sinks)
            else:
                self.kv.write_full(i, table, pos, k[rows], v[rows])
                k_all, v_all = self.kv.read_full(i, table, entry.end_position)
                k_pos = torch.arange(entry.end_position, device=q.device)
                out[rows] = blocked_attention(q[rows], k_all.to(q.dtype), v_all.to(q.dtype), sinks, pos, k_pos, None)
        return out.reshape(q.shape[0], c.q_size)

    def _sliding(self, i: int, entry: ScheduledRequest, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """The chunk reads its ring's history and its own fresh K/V, then writes its last keys.

            positions   ... s-w+1 ........ s-1 | s ......... s+c-1
                            history (ring)       this chunk (fresh)
        """
        window, s = self.config.sliding_window, entry.start_position
        history = torch.arange(max(0, s - window + 1), s, device=pos.device)
        k_old, v_old = self.kv.read_ring(i, entry.ring_slot, history)
        # the chunk's own keys as the cache will hold them: attention sees one rounding (FP8 caches)
        k_all = torch.cat((k_old.to(k.dtype), self.kv.rounded(k)))
        v_all = torch.cat((v_old.to(v.dtype), self.kv.rounded(v)))
        out = blocked_attention(q, k_all, v_all, sinks, pos, torch.cat((history, pos)), window)
        self.kv.write_ring(i, entry.ring_slot, pos, k, v)
        return out


class TorchOps(AttentionOps):
    """Every operation of `forward` in torch (see the module docstring)."""

    def embed(self) -> torch.Tensor:
        return self.model.w("model.embed_tokens.weight")[self.rows.token_ids]

    def resume(self) -> torch.Tensor:
        raise NotImplementedError("the torch path runs a step's layers in one call")

    def layers(self, first: int, last: int) -> None:
        return None

    def rms_norm(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        return rms_norm(x, self.model.w(weight), self.config.rms_norm_eps)

    def qkv(self, i: int, x: torch.Tensor):
        c, t, p = self.config, x.shape[0], f"model.layers.{i}.self_attn."
        q = self.linear(x, p + "q_proj.weight").view(t, c.num_attention_heads, c.head_dim)
        k = self.linear(x, p + "k_proj.weight").view(t, c.num_key_value_heads, c.head_dim)
        v = self.linear(x, p + "v_proj.weight").view(t, c.num_key_value_heads, c.head_dim)
        return self.norm_rope(i, q, k, v)

    def linear(self, x: torch.Tensor, weight: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ self.model.w(weight).t()
        return y if residual is None else residual + y

    def gate_up(self, x: torch.Tensor, gate: str, up: str) -> torch.Tensor:
        return F.silu(self.linear(x, gate)) * self.linear(x, up)

    def linear_norm(self, x: torch.Tensor, weight: str, residual: torch.Tensor, norm: str | None):
        h = self.linear(x, weight, residual)
        return h, None if norm is None else self.rms_norm(h, norm)

    def moe(self, i: int, x: torch.Tensor, residual: torch.Tensor, norm: str | None = None):
        h = residual + self.model.moe(i, x)
        return h, None if norm is None else self.rms_norm(h, norm)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        last = self.rms_norm(h[self.rows.logit_rows], "model.norm.weight")
        return self.linear(last, "lm_head.weight").float()
