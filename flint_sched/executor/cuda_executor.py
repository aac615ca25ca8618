"""CudaExecutor: low-latency decode (<= 8 requests) on our kernels, replayed from one CUDA graph per
batch size; every other step (prefill chunks, larger batches) runs on the torch path.

Both paths share one KVCache. A decode step copies its inputs (token ids, positions, block tables,
ring slots) into static buffers, replays the graph for its batch size, and reads back the greedy
token ids (or the logits, for requests that sample otherwise). The graph for batch b is captured on
first use; attention splits come from the host bound `max_model_len`, and per-request lengths are
read on the device, so one graph serves every context length.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from flint_sched.checkpoint.common import Weights
from flint_sched.config import FlintConfig
from flint_sched.core.plan import StepPlan, StepResult
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.sampler import draw, filter_rows
from flint_sched.executor.torch_executor import TorchExecutor
from flint_sched.kernels import attention as attn
from flint_sched.kernels.linear import concat_rows, gate_up_silu, linear
from flint_sched.kernels.moe import moe_down, moe_gate_up, route, router_workspace
from flint_sched.kernels.norm import rms_norm
from flint_sched.kernels.sampling import argmax_workspace, greedy
from flint_sched.quant.nvfp4 import NVFP4Tensor

MAX_DECODE_BATCH = 8
# Launching one graph of ~450 kernels takes 0.14-0.38 ms of host time on the H200 machine, and the
# GPU starts on a graph only once its launch returns; a small first graph lets it start early
# (benchmarks/RESULTS.md). Each graph boundary costs a few µs (no PDL overlap across it).
FIRST_GRAPH_LAYERS = 3
INPUT_ROWS = ("tokens", "positions", "seq_lens", "ring_slots", "table_index", "table_value")


def supports(config: FlintConfig) -> bool:
    """The kernels' fixed shapes: head_dim 128, 8 query heads per KV head, at most 8 KV heads."""
    return (config.head_dim == attn.HEAD_DIM and config.num_queries_per_kv == attn.GROUP
            and config.num_key_value_heads <= attn.MAX_KV_HEADS and config.hidden_size % 64 == 0)


def graph_segments(num_layers: int, first_graph_layers: int) -> list[tuple[int, int]]:
    """[first, last) layer ranges of the step's graphs: `first_graph_layers`, then 4x as many,
    then the rest (0: one graph). Each graph's launch (host time ~ its size) then fits in the GPU
    time of the graphs before it, and only the small first one is waited for."""
    first = first_graph_layers
    if not 0 < first < num_layers:
        return [(0, num_layers)]
    second = min(num_layers, 5 * first)
    return [(0, first), (first, second)] + ([(second, num_layers)] if second < num_layers else [])


def _kernel_weight(w: torch.Tensor | NVFP4Tensor, device: torch.device):
    if isinstance(w, NVFP4Tensor):
        return w.to(device)
    return w.to(device, torch.float32 if w.dtype == torch.float32 else torch.bfloat16)


class _Buffers:
    """Static inputs, activations and workspaces, sized for MAX_DECODE_BATCH."""

    def __init__(self, c: FlintConfig, max_blocks: int, device: torch.device):
        b, bf16, i32 = MAX_DECODE_BATCH, torch.bfloat16, torch.int32
        # Per-step inputs, one row each: tokens, positions, seq_lens, ring_slots, and one block-table
        # entry to write (flat index, value); filled on the host and copied in one transfer.
        self.inputs = torch.zeros(len(INPUT_ROWS), b, dtype=i32, device=device)
        self.inputs_host = torch.zeros_like(self.inputs, device="cpu", pin_memory=device.type == "cuda")
        self.tokens, self.positions, self.seq_lens, self.ring_slots, self.table_index, self.table_value = self.inputs
        # The last element is where rows with no new block entry write.
        self.block_tables_flat = torch.zeros(b * max_blocks + 1, dtype=i32, device=device)
        self.block_tables = self.block_tables_flat[:-1].view(b, max_blocks)
        self.hidden = [torch.zeros(b, c.hidden_size, dtype=bf16, device=device) for _ in range(2)]
        self.normed = torch.zeros(b, c.hidden_size, dtype=bf16, device=device)
        self.qkv = torch.zeros(b, c.q_size + 2 * c.kv_size, dtype=bf16, device=device)
        self.q = torch.zeros(b, c.num_attention_heads, c.head_dim, dtype=bf16, device=device)
        self.attn_out = torch.zeros(b, c.num_attention_heads, c.head_dim, dtype=bf16, device=device)
        self.mlp_hidden = torch.zeros(b, c.intermediate_size, dtype=bf16, device=device)
        self.expert_ids = torch.zeros(b, c.num_experts_per_tok, dtype=i32, device=device)
        self.expert_weights = torch.zeros(b, c.num_experts_per_tok, dtype=torch.float32, device=device)
        self.expert_hidden = torch.zeros(b, c.num_experts_per_tok + 1, c.moe_intermediate_size, dtype=bf16,
                                         device=device)
        self.logits = torch.zeros(b, c.vocab_size, dtype=bf16, device=device)
        self.next_tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.attention_workspace = attn.attention_workspace(device, MAX_DECODE_BATCH, c.num_key_value_heads)
        self.router_workspace = router_workspace(c.n_routed_experts, device)
        self.argmax_workspace = argmax_workspace(MAX_DECODE_BATCH, c.vocab_size, device)


class CudaExecutor:
    def __init__(self, config: FlintConfig, weights: Weights, kv_cache: KVCache, eos_token_ids: Collection[int],
                 max_model_len: int, device: torch.device | str = "cuda", seed: int = 0, use_graphs: bool = True,
                 pdl: bool = True, first_graph_layers: int = FIRST_GRAPH_LAYERS):
        """`pdl`: launch every kernel with programmatic dependent launch, so each one starts while its
        predecessor drains (every kernel waits with griddepcontrol.wait before reading inputs).
        `first_graph_layers`: the step is captured as three graphs (`graph_segments`), so that the
        GPU starts on the first while the host still launches the rest (0: one graph)."""
        if not supports(config):
            raise ValueError("the CUDA kernels need head_dim 128 and 8 query heads per KV head")
        self.config = config
        self.device = torch.device(device)
        self.kv = kv_cache
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        self.pdl = pdl
        self.segments = graph_segments(config.num_hidden_layers, first_graph_layers)
        self.w = {name: _kernel_weight(t, self.device) for name, t in weights.items()}
        self.qkv = {i: self._fuse_qkv(f"model.layers.{i}.self_attn.") for i in range(config.num_hidden_layers)}
        self.fallback = TorchExecutor(config, self.w, kv_cache, eos_token_ids, torch.bfloat16, self.device, seed,
                                      dequantize_once=False)
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.buf = _Buffers(config, max_blocks, self.device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)             # the graph sampler's noise (torch's CUDA generator)
        self.sampler = GraphSampler(self.buf.logits, self.buf.next_tokens)
        self._table_rows: list[tuple[str, int] | None] = [None] * MAX_DECODE_BATCH  # (request, entries on device)
        # Set to a list (with use_graphs off) to receive each layer's output hidden state [B, hidden].
        self.layer_outputs: list[torch.Tensor] | None = None
        self.last_logits: torch.Tensor | None = None

    def _fuse_qkv(self, prefix: str):
        """q, k and v as one weight for one GEMV (NVFP4: each part keeps its tensor scale); the torch
        path's q, k, v become views of it, so the weights are held once."""
        names = [f"{prefix}{n}_proj.weight" for n in "qkv"]
        fused, splits = concat_rows([self.w[n] for n in names])
        for n, part, start, end in zip(names, range(3), (0, *splits), (*splits, fused.shape[0]), strict=True):
            if isinstance(fused, NVFP4Tensor):
                self.w[n] = NVFP4Tensor(fused.codes[start:end], fused.block_scales[start:end],
                                        fused.tensor_scale[part: part + 1])
            else:
                self.w[n] = fused[start:end]
        return fused, splits

    # -- dispatch ------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        entries = plan.scheduled_requests
        self._forget(plan)
        if not (plan.path == "low_latency" and 0 < len(entries) <= MAX_DECODE_BATCH):
            return self.fallback.execute(plan)
        b = len(entries)
        self._fill_inputs(plan)
        if self.use_graphs:
            for graph in self._graphs(b):
                graph.replay()
        else:
            for first, last in self.segments:
                self._decode(b, first, last)
        self.last_logits = self.buf.logits[:b]
        if all(e.sampling_params.is_greedy and _plain(e) for e in entries):
            tokens = self.buf.next_tokens[:b].tolist()
        elif all(_plain(e) and e.sampling_params.seed is None for e in entries) and self.use_graphs:
            tokens = self.sampler(entries)
        else:
            return self.fallback.sample(self.buf.logits[:b].float(), entries)
        return StepResult({e.request_id: [t] for e, t in zip(entries, tokens, strict=True)})

    def _fill_inputs(self, plan: StepPlan) -> None:
        """One pinned host-to-device copy of the step's inputs. The device block tables are kept
        across steps: a row is rewritten when its request changes, otherwise only the entries the
        request gained since (one per block in steady decode, as an in-graph scatter)."""
        entries, buf = plan.scheduled_requests, self.buf
        host = buf.inputs_host.numpy()
        width = buf.block_tables.shape[1]
        dummy = buf.block_tables_flat.numel() - 1
        for row, e in enumerate(entries):
            table, known = e.block_table, self._table_rows[row]
            index, value = dummy, 0
            if known is None or known[0] != e.request_id or len(table) < known[1]:
                self._copy_table(row, table, 0)
            elif len(table) == known[1] + 1:
                index, value = row * width + known[1], table[-1]
            elif len(table) > known[1]:
                self._copy_table(row, table, known[1])
            self._table_rows[row] = (e.request_id, len(table))
            host[:, row] = (e.token_ids[0], e.start_position, e.start_position + 1, e.ring_slot, index, value)
        buf.inputs.copy_(buf.inputs_host, non_blocking=True)     # 192 bytes, contiguous

    def _copy_table(self, row: int, table: list[int], start: int) -> None:
        if len(table) > self.buf.block_tables.shape[1]:
            raise ValueError(f"block table of {len(table)} blocks exceeds max_model_len {self.max_model_len}")
        self.buf.block_tables[row, start: len(table)].copy_(torch.tensor(table[start:], dtype=torch.int32))

    def _forget(self, plan: StepPlan) -> None:
        """Rows of preempted or finished requests are rewritten when next used."""
        gone = set(plan.preempted_request_ids) | set(plan.finished_request_ids)
        if gone:
            self._table_rows = [None if k is not None and k[0] in gone else k for k in self._table_rows]

    def _graphs(self, b: int) -> list[torch.cuda.CUDAGraph]:
        if self.layer_outputs is not None:
            raise RuntimeError("layer_outputs needs use_graphs=False")
        graphs = self.graphs.get(b)
        if graphs is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for first, last in self.segments:
                    self._decode(b, first, last)      # loads every kernel before capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graphs = []
            for first, last in self.segments:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
                    self._decode(b, first, last)
                graphs.append(graph)
            self.graphs[b] = graphs
        return graphs

    # -- the decode step -----------------------------------------------------------------------

    def _decode(self, b: int, first: int, last: int) -> None:
        """Layers [first, last) of the step; the first segment starts with the embedding, the last
        ends with the LM head and the greedy token. Each layer starts and ends in buf.hidden[0]."""
        c, buf, w, eps = self.config, self.buf, self.w, self.config.rms_norm_eps
        h, h_next = buf.hidden[0][:b], buf.hidden[1][:b]
        if first == 0:
            buf.block_tables_flat.index_put_((buf.table_index[:b],), buf.table_value[:b])
            torch.index_select(w["model.embed_tokens.weight"], 0, buf.tokens[:b], out=h)
        for i in range(first, last):
            p = f"model.layers.{i}."
            normed = rms_norm(h, w[p + "input_layernorm.weight"], eps, out=buf.normed[:b], pdl=self.pdl)
            self._attention(i, b, normed)
            linear(buf.attn_out[:b].view(b, c.q_size), w[p + "self_attn.o_proj.weight"], residual=h, out=h_next,
                   pdl=self.pdl)
            h, h_next = h_next, h
            normed = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps, out=buf.normed[:b], pdl=self.pdl)
            if c.is_moe(i):
                self._moe(i, b, normed, residual=h, out=h_next)
            else:
                up = gate_up_silu(normed, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                  out=buf.mlp_hidden[:b], pdl=self.pdl)
                linear(up, w[p + "mlp.down_proj.weight"], residual=h, out=h_next, pdl=self.pdl)
            h, h_next = h_next, h
            if self.layer_outputs is not None:
                self.layer_outputs.append(h.clone())
        if last < c.num_hidden_layers:
            return
        normed = rms_norm(h, w["model.norm.weight"], eps, out=buf.normed[:b], pdl=self.pdl)
        linear(normed, w["lm_head.weight"], out=buf.logits[:b], pdl=self.pdl)
        greedy(buf.logits[:b], out=buf.next_tokens[:b], workspace=buf.argmax_workspace, pdl=self.pdl)

    def _attention(self, i: int, b: int, normed: torch.Tensor) -> None:
        c, buf, w = self.config, self.buf, self.w
        p = f"model.layers.{i}.self_attn."
        qkv = buf.qkv[:b]
        weight, splits = self.qkv[i]
        linear(normed, weight, out=qkv, pdl=self.pdl, row_splits=splits)
        q, out, sinks = buf.q[:b], buf.attn_out[:b], w[p + "sinks"]
        if c.is_sliding(i):
            ring = self.kv.ring[self.kv.ring_index[i]]
            attn.qk_norm_rope_kv_sliding(qkv, w[p + "q_norm.weight"], w[p + "k_norm.weight"], buf.positions[:b],
                                         ring[0], ring[1], buf.ring_slots[:b], c.rms_norm_eps, c.rope_theta,
                                         q_out=q, pdl=self.pdl)
            attn.decode_attention_sliding(q, ring[0], ring[1], buf.ring_slots[:b], buf.seq_lens[:b], sinks,
                                          buf.attention_workspace, out=out, pdl=self.pdl)
        else:
            full = self.kv.full[self.kv.full_index[i]]
            tables = buf.block_tables[:b]
            attn.qk_norm_rope_kv_full(qkv, w[p + "q_norm.weight"], w[p + "k_norm.weight"], buf.positions[:b],
                                      full[0], full[1], tables, c.rms_norm_eps, q_out=q, pdl=self.pdl)
            attn.decode_attention_full(q, full[0], full[1], tables, buf.seq_lens[:b], sinks,
                                       buf.attention_workspace, self.max_model_len, out=out, pdl=self.pdl)

    def _moe(self, i: int, b: int, normed: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
        c, buf, w = self.config, self.buf, self.w
        p = f"model.layers.{i}.mlp."
        ids, weights = route(normed, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"],
                             c.num_experts_per_tok, c.routed_scaling_factor, ids=buf.expert_ids[:b],
                             weights=buf.expert_weights[:b], workspace=buf.router_workspace, pdl=self.pdl)
        shared = c.n_shared_experts > 0
        hidden = moe_gate_up(normed, ids, w[p + "experts.gate_proj.weight"], w[p + "experts.up_proj.weight"],
                             w[p + "shared_experts.gate_proj.weight"] if shared else None,
                             w[p + "shared_experts.up_proj.weight"] if shared else None,
                             out=buf.expert_hidden[:b], pdl=self.pdl)
        moe_down(hidden, ids, weights, w[p + "experts.down_proj.weight"],
                 w[p + "shared_experts.down_proj.weight"] if shared else None, residual=residual, out=out,
                 pdl=self.pdl)

def _plain(entry) -> bool:
    """Token choice from the logits as they are: no edits first (bans, bias, penalties), no logprobs."""
    p = entry.sampling_params
    return not (p.logit_bias or p.min_tokens > len(entry.output_token_ids) or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty or p.logprobs is not None)


class GraphSampler:
    """Temperature / top-k / top-p / min-p sampling of a decode batch from the executor's logits,
    captured in one CUDA graph per (batch size, masks in use) (a dozen kernels, a sort unless only
    temperature is set, and no host work); greedy rows of the batch keep the graph's argmax. Per-step parameters arrive in one
    pinned copy. The noise comes from torch's default CUDA generator (graph-safe), which the
    executor seeds; seeded requests and edited logits go through executor/sampler.py instead."""

    def __init__(self, logits: torch.Tensor, greedy_tokens: torch.Tensor):
        self.logits, self.greedy_tokens = logits, greedy_tokens
        rows, vocab = logits.shape
        self.vocab = vocab
        self.params = torch.zeros(5, rows, dtype=torch.float32, device=logits.device)
        self.params_host = torch.zeros_like(self.params, device="cpu", pin_memory=True)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def __call__(self, entries) -> list[int]:
        b, host = len(entries), self.params_host.numpy()
        for row, e in enumerate(entries):
            p = e.sampling_params
            host[:, row] = (1.0 if p.is_greedy else p.temperature, p.top_k if 0 < p.top_k < self.vocab else self.vocab,
                            p.top_p, p.min_p, p.is_greedy)
        self.params.copy_(self.params_host, non_blocking=True)
        # Masks no row needs stay out of the graph (pure temperature sampling sorts nothing).
        key = (b, bool((host[1, :b] < self.vocab).any()), bool((host[2, :b] < 1.0).any()), bool(host[3, :b].any()))
        graph = self.graphs.get(key)
        if graph is None:
            self._sample(*key)                       # warm-up outside the capture (sort workspace, kernels)
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._sample(*key)
        graph.replay()
        return self.tokens[:b].tolist()

    def _sample(self, b: int, use_top_k: bool, use_top_p: bool, use_min_p: bool) -> None:
        temperature, top_k, top_p, min_p, greedy = self.params[:, :b]
        logits = filter_rows(self.logits[:b].float(), temperature, top_k, top_p, min_p, use_top_k, use_top_p,
                             use_min_p)
        self.tokens[:b] = torch.where(greedy > 0, self.greedy_tokens[:b], draw(torch.softmax(logits, dim=-1)))
