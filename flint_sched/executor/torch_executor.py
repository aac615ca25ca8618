"""TorchExecutor: runs a StepPlan with plain torch on any device, on the paged KV layout.

All tokens of the step (prefill chunks and decodes of many requests) go through each layer's
projections and MLP together; attention runs per request, reading its block table (full layers)
or its ring slot (sliding layers). Only the last token of a sampling entry reaches the LM head.
The model math is the reference's (model/reference.py); this file adds the paging and batching.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from flint_sched.checkpoint.common import Weights
from flint_sched.config import FlintConfig
from flint_sched.core.plan import ScheduledRequest, StepPlan, StepResult
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.sampler import sample_batch
from flint_sched.model.reference import FlintReference, attention_with_sinks, rms_norm
from flint_sched.quant.nvfp4 import NVFP4Tensor

QUERY_BLOCK = 256   # query rows per attention call on full layers: scores are [heads, rows, context]


def dense_weights(weights: Weights, dtype: torch.dtype, device: torch.device) -> Weights:
    """Dequantize NVFP4 weights once; fp32 tensors (the correction bias) stay fp32."""
    out = {}
    for name, w in weights.items():
        if isinstance(w, NVFP4Tensor):
            out[name] = w.to(device).dequantize(dtype)
        else:
            out[name] = w.to(device, torch.float32 if w.dtype == torch.float32 else dtype)
    return out


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                      q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """attention_with_sinks over QUERY_BLOCK query rows at a time (long prefill chunks)."""
    if q.shape[0] <= QUERY_BLOCK:
        return attention_with_sinks(q, k, v, sinks, q_pos, k_pos, window)
    return torch.cat([attention_with_sinks(q[a:a + QUERY_BLOCK], k, v, sinks, q_pos[a:a + QUERY_BLOCK], k_pos, window)
                      for a in range(0, q.shape[0], QUERY_BLOCK)])


class TorchExecutor:
    def __init__(self, config: FlintConfig, weights: Weights, kv_cache: KVCache, eos_token_ids: Collection[int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
                 dequantize_once: bool = True):
        """`dequantize_once=False` keeps NVFP4 weights packed and dequantizes each one when used
        (slower, but no second copy of the weights: the CUDA executor's fallback)."""
        self.config = config
        self.device = torch.device(device)
        if dequantize_once:
            weights = dense_weights(weights, dtype, self.device)
        self.model = FlintReference(config, weights, dtype, self.device)
        self.kv = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        entries = plan.scheduled_requests
        if not entries:
            return StepResult({})
        dev = self.device
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(e.start_position, e.end_position) for e in entries]).to(dev)
        tables = [torch.tensor(e.block_table, dtype=torch.long, device=dev) for e in entries]
        m = self.model
        x = m.w("model.embed_tokens.weight")[ids]
        for i in range(self.config.num_hidden_layers):
            x = self._layer(i, x, positions, entries, tables)
        sampling = [n for n, e in enumerate(entries) if e.samples]
        if not sampling:
            return StepResult({})
        ends = torch.tensor([e.num_tokens for e in entries], device=dev).cumsum(0) - 1
        last = x[ends[sampling]]
        logits = (rms_norm(last, m.w("model.norm.weight"), self.config.rms_norm_eps)
                  @ m.w("lm_head.weight").t()).float()
        return self.sample(logits, [entries[n] for n in sampling])

    def sample(self, logits: torch.Tensor, entries: list[ScheduledRequest]) -> StepResult:
        """One token per entry from its fp32 logits row (one batched pass, one read-back)."""
        tokens, logprobs = {}, {}
        for entry, (token, lp) in zip(entries, sample_batch(logits, entries, self.eos_token_ids, self.generator),
                                      strict=True):
            tokens[entry.request_id] = [token]
            if lp is not None:
                logprobs[entry.request_id] = [lp]
        return StepResult(tokens, logprobs or None)

    def _layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, entries: list[ScheduledRequest],
               tables: list[torch.Tensor]) -> torch.Tensor:
        m, eps, p = self.model, self.config.rms_norm_eps, f"model.layers.{i}."
        h = x + self._attention(i, rms_norm(x, m.w(p + "input_layernorm.weight"), eps), positions, entries, tables)
        return h + m.mlp(i, rms_norm(h, m.w(p + "post_attention_layernorm.weight"), eps))

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, entries: list[ScheduledRequest],
                   tables: list[torch.Tensor]) -> torch.Tensor:
        c, m, p = self.config, self.model, f"model.layers.{i}.self_attn."
        n = x.shape[0]
        q, k, v = m.qkv(i, x, positions)
        sliding = c.is_sliding(i)
        sinks = m.w(p + "sinks")
        out = torch.empty_like(q)
        start = 0
        for entry, table in zip(entries, tables, strict=True):
            rows = slice(start, start + entry.num_tokens)
            start += entry.num_tokens
            pos = positions[rows]
            if sliding:
                out[rows] = self._sliding_attention(i, entry, pos, q[rows], k[rows], v[rows], sinks)
            else:
                self.kv.write_full(i, table, pos, k[rows], v[rows])
                k_all, v_all = self.kv.read_full(i, table, entry.end_position)
                k_pos = torch.arange(entry.end_position, device=x.device)
                out[rows] = blocked_attention(q[rows], k_all, v_all, sinks, pos, k_pos, None)
        return out.reshape(n, c.q_size) @ m.w(p + "o_proj.weight").t()

    def _sliding_attention(self, i: int, entry: ScheduledRequest, pos: torch.Tensor, q: torch.Tensor,
                           k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """The chunk reads its ring's history and its own fresh K/V, then writes its last keys.

            positions   ... s-w+1 ........ s-1 | s ......... s+c-1
                            history (ring)       this chunk (fresh)
        """
        window, s = self.config.sliding_window, entry.start_position
        history = torch.arange(max(0, s - window + 1), s, device=pos.device)
        k_old, v_old = self.kv.read_ring(i, entry.ring_slot, history)
        k_all = torch.cat((k_old.to(k.dtype), k))
        v_all = torch.cat((v_old.to(v.dtype), v))
        out = blocked_attention(q, k_all, v_all, sinks, pos, torch.cat((history, pos)), window)
        self.kv.write_ring(i, entry.ring_slot, pos, k, v)
        return out
