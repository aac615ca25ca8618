"""CudaExecutor: every step on our kernels (executor/kernel_ops.py), through the one forward.

    plan                                   variant    how
    <= 6 one-token decodes ("fused")       fused      CUDA graph per batch size 1..6 (BF16 weights: 8;
                                                      FUSED_PATH_MAX_BATCH)
    more decodes, up to the largest size   grouped    CUDA graph per padded batch size (graphs.py)
    prompt chunks (mixed steps), or more   prompt     CUDA graph per padded row count up to 2,048
                                                      (graphs.PROMPT_GRAPH_TOKENS), eager above

A mixed step (prompt chunks beside running decodes) is one forward of the prompt variant over all
rows, a decode being a chunk of one token, so every weight is read once for both. Past
ONE_FORWARD_MAX_CONTEXT a decode's attention is better served by the split-KV decode kernel (and
from MIXED_SPLIT_MIN_DECODES decodes, an option, their experts may be read apart): then the decode
rows replay their graph and the prompt chunks run after it.

Every variant shares one KVCache and the same weights. Decode steps copy their inputs into static
buffers (step_inputs.py) and keep the greedy ids, or sample in a graph (graph_sampler.py), or
sample the logits through executor/sampler.py (seeds, logit edits, logprobs). `launch` runs a step
without waiting for it: the sampled tokens stay on the device for the next step's placeholders and
reach the host in `collect` (sampled_tokens.py; `execute` is both). Attention splits
come from the host bound `max_model_len` and lengths are read on the device, so one graph serves
every context length.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection

import torch

from flint_sched.checkpoint.common import Weights
from flint_sched.config import FlintConfig
from flint_sched.core.plan import ScheduledRequest, StepPlan, StepResult
from flint_sched.executor import kernel_ops
from flint_sched.executor.dense_copies import make_copies
from flint_sched.executor.forward import forward
from flint_sched.executor.grammar_masks import GrammarMasks
from flint_sched.executor.graph_sampler import GraphSampler, plain
from flint_sched.executor.gpu_timeline import GpuTimeline
from flint_sched.executor.graphs import (
    FIRST_GRAPH_LAYERS,
    GROUPED_BATCH_SIZES,
    PROMPT_GRAPH_TOKENS,
    StepGraphs,
    graph_segments,
    padded_batch,
)
from flint_sched.executor.kernel_ops import KernelOps, KernelWeights
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.executor.moe_gemms import expert_format, hybrid_available, hybrid_rows, mixed_moe_gemms
from flint_sched.executor.prompt_logprobs import prompt_logprobs, prompt_spans
from flint_sched.executor.prompt_logprobs import prompt_rows as logprob_rows
from flint_sched.executor.sampled_tokens import LaunchedStep, SampledTokens, one_token_each
from flint_sched.executor.sampler import sampled_step
from flint_sched.executor.step_inputs import DecodeInputs
from flint_sched.executor.workspace import Workspaces
from flint_sched.kernels import attention as attn
from flint_sched.kernels.linear import MAX_TOKENS, concat_rows
from flint_sched.kernels.prefill_attention import Chunk, PrefillBuffers, prefill_metadata
from flint_sched.quant.nvfp4 import NVFP4Tensor
from flint_sched.sampling_params import SamplingParams

FUSED_MAX_BATCH = MAX_TOKENS      # the GEMV and small-batch MoE kernels' limit (kernels/linear.py)
_SAMPLES = operator.attrgetter("samples")
_GREEDY = operator.attrgetter("sampling_params.is_greedy")
# Decode steps of at most this many requests take the fused path (the executor's
# limits.fused_max_batch), by weight format; above, the grouped path. Full model, NVFP4, 1K context,
# ms a step fused / grouped (its 16-row graph; tmpdev probe, RESULTS.md session 24): 1 request 1.95 /
# 3.19, 2: 2.30 / 3.27, 4: 2.97 / 3.52, 6: 3.60 / 3.65, 8: 4.22 / 3.80. BF16: not measured, the
# fused kernels' limit.
FUSED_PATH_MAX_BATCH = {"nvfp4": 6, "bf16": FUSED_MAX_BATCH}
# NOTE: the prefill attention kernel gives a one-token chunk one CTA per KV head and no split over
# its keys (~1 µs per 64 keys): ~70 µs a full layer at 4K, 0.5 ms at 32K, for all decodes at once,
# against a decode graph step (weights read a second time) of 6-22 ms at batch 16-256 (H200, NVFP4).
ONE_FORWARD_MAX_CONTEXT = 32768
# Mixed steps of at least this many decode rows could run them apart too (their decode graph, then
# the prompt chunks as a step of their own): in one forward the decode rows' experts, at 256 decodes
# nearly all of them with a few rows each, are read a second time beside the prompt's, and their
# attention runs on the prefill kernel. Off: each such step alone was 4-17 % shorter apart (64:
# 64 + 1,024 prompt rows 23.2 against 24.1 ms, 256 + 7,936 139.8 against 147.7), but served at 256
# streams the split lost (13,902 against 14,644 tok/s, session 24), and again without the stream
# sync the split path then had (13,967 against 14,499, one machine, session 25: GPU busy 37.1 against
# 35.8 s); the served steps are not the benchmark's (RESULTS.md). An option for serve_runs.sh's SERVE_SET.
MIXED_SPLIT_MIN_DECODES = 1 << 30


def supports(config: FlintConfig) -> bool:
    """The kernels' fixed shapes: head_dim 128, 8 query heads per KV head, at most 8 KV heads."""
    return (config.head_dim == attn.HEAD_DIM and config.num_queries_per_kv == attn.GROUP
            and config.num_key_value_heads <= attn.MAX_KV_HEADS and config.hidden_size % 64 == 0)


def prompt_rows(entries: list) -> tuple[list[int], list[int]]:
    """Token ids of a prompt step's rows (entries one after another), and the last row of each entry
    that samples (the rows whose logits are needed)."""
    ids, sample_rows, end = [], [], 0
    for e in entries:
        ids.extend(e.token_ids)
        end += e.num_tokens
        if e.samples:
            sample_rows.append(end - 1)
    return ids, sample_rows


def _kernel_weight(w: torch.Tensor | NVFP4Tensor, device: torch.device):
    if isinstance(w, NVFP4Tensor):
        return w.to(device)
    return w.to(device, torch.float32 if w.dtype == torch.float32 else torch.bfloat16)


class CudaExecutor:
    grammars: GrammarMasks | None = None           # structured outputs; set by the engine builder
    _hybrid_moe = False                            # the experts fit the hybrid GEMMs (mixed_moe_gemms)

    def __init__(self, config: FlintConfig, weights: Weights, kv_cache: KVCache, eos_token_ids: Collection[int],
                 max_model_len: int, device: torch.device | str = "cuda", seed: int = 0, use_graphs: bool = True,
                 pdl: bool = True, first_graph_layers: int = FIRST_GRAPH_LAYERS,
                 grouped_batch_sizes: tuple[int, ...] = GROUPED_BATCH_SIZES,
                 prompt_graph_tokens: tuple[int, ...] = PROMPT_GRAPH_TOKENS, dense_copies: bool = True):
        """`pdl`: launch every kernel with programmatic dependent launch, so each one starts while its
        predecessor drains (every kernel waits with griddepcontrol.wait before reading inputs).
        `first_graph_layers`: the step is captured as three graphs (`graph_segments`), so that the
        GPU starts on the first while the host still launches the rest (0: one graph).
        `grouped_batch_sizes`: the padded batch sizes of the grouped path's graphs.
        `prompt_graph_tokens`: the padded row counts of prompt steps replayed from graphs (() or
        use_graphs False: every prompt step eager).
        `dense_copies`: keep bf16 copies of NVFP4 dense weights for the steps that run them on
        cuBLAS (executor/dense_copies.py; the engine reserves their memory)."""
        if not supports(config):
            raise ValueError("the CUDA kernels need head_dim 128 and 8 query heads per KV head")
        self.config = config
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        self.grouped_batch_sizes = grouped_batch_sizes
        max_rows = max((FUSED_MAX_BATCH, *grouped_batch_sizes))
        self.w = {name: _kernel_weight(t, self.device) for name, t in weights.items()}
        self.limits = self._limits()
        qkv = {i: self._fuse_qkv(f"model.layers.{i}.self_attn.") for i in range(config.num_hidden_layers)}
        self.prompt_graph_tokens = tuple(sorted(prompt_graph_tokens)) if use_graphs else ()
        self.ws = Workspaces(config, max_rows, kv_cache.ring.shape[2], self.device,
                             prompt_graph_rows=max(self.prompt_graph_tokens, default=0))
        # (padded rows, decodes apart) -> (PrefillBuffers, hidden, token ids, sample rows)
        self._prompt_static: dict[tuple[int, bool], tuple] = {}
        self._prompt_shared: tuple | None = None       # what the sizes' views are of (_prompt_buffers)
        self.weights = KernelWeights(config, self.w, qkv, kv_cache, self.ws, pdl,
                                     make_copies(self.w, qkv, self.device) if dense_copies else None)
        self._hybrid_moe = hybrid_available(config, self.w)
        # Every sampling row of a step holds a ring slot: room for one token per slot.
        self.sampled = SampledTokens(max(kv_cache.ring.shape[2], max_rows), self.device)
        self.timeline = GpuTimeline() if self.device.type == "cuda" else None   # /metrics: GPU busy and idle
        self.inputs = DecodeInputs(max_rows, max_model_len, kv_cache.block_size, self.device, self.sampled.values)
        self.graphs = StepGraphs(self.device, graph_segments(config.num_hidden_layers, first_graph_layers))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)             # the graph sampler's noise (torch's CUDA generator)
        self.sampler = GraphSampler(self.ws.logits, self.ws.next_tokens, self.limits.graph_batch_sizes,
                                    self.graphs.pool if self.device.type == "cuda" else None)
        # Set to a list (with use_graphs off) to receive each layer's output hidden state [B, hidden].
        self.layer_outputs: list[torch.Tensor] | None = None
        self.last_logits: torch.Tensor | None = None

    def _limits(self) -> ExecutorLimits:
        """The fused path up to FUSED_PATH_MAX_BATCH of the experts' format, graphs of every batch size."""
        fused = FUSED_PATH_MAX_BATCH[expert_format(self.config, self.w) or "bf16"]
        return ExecutorLimits(fused, tuple(range(1, fused + 1)) + self.grouped_batch_sizes)

    def clear_graphs(self) -> None:
        """Drop the captured steps and sampling graphs (a benchmark changing kernels between
        captures); the next steps capture them again, in a new pool. The limits are taken again
        from FUSED_PATH_MAX_BATCH (benchmarks/ab_decode.py variants; an engine's scheduler keeps
        the limits it was built with, and builds no variants)."""
        self.graphs.clear()
        self.sampler.graphs.clear()
        self.sampler.pool = self.graphs.pool if self.device.type == "cuda" else None
        self.limits = self._limits()

    @property
    def kv(self) -> KVCache:
        return self.weights.kv

    @kv.setter
    def kv(self, kv: KVCache) -> None:
        self.weights.kv = kv

    def _fuse_qkv(self, prefix: str):
        """q, k and v as one weight for one GEMM (NVFP4: each part keeps its tensor scale); the
        separate names become views of it, so the weights are held once."""
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
        return self.launch(plan).collect()

    def warm_up(self, max_prompt_tokens: int, max_num_seqs: int | None = None) -> None:
        """Compile the kernels and capture the graphs before the first request: the prompt graphs, a
        prompt step of up to max_prompt_tokens tokens, then a fused and a grouped decode step, each
        greedy and sampled (temperature 1, the OpenAI default: the sampler's graphs and kernels),
        then the other grouped decode sizes that fit the ring slots and a batch of max_num_seqs
        needs, on free KV blocks and ring slots (nothing reads them before a request writes them).
        On a machine whose kernel cache is cold the first requests otherwise wait for ~20 s of NVRTC
        compiles."""
        kv = self.kv
        slots, bs = kv.ring.shape[2], kv.block_size
        n = max(1, min(max_prompt_tokens, self.max_model_len - 2, (kv.full.shape[2] - 1) * bs))
        table = list(range(n // bs + 1))
        ids = [f"warm-up-{i}" for i in range(min(slots, self.grouped_batch_sizes[0]))]
        greedy_and_sampled = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))

        def entry(rid: str, tokens: list[int], start: int, slot: int, params: SamplingParams) -> ScheduledRequest:
            return ScheduledRequest(rid, tokens, start, table, slot, True, params, [], [], False)

        def decodes(names: list[str], params: SamplingParams) -> StepPlan:
            """One token at position n for each name, ring slot = its index (position n fits the table)."""
            return StepPlan([entry(i, [0], n, slot, params) for slot, i in enumerate(names)], len(names),
                            "grouped" if len(names) > self.limits.fused_max_batch else "fused", [], [])

        # The prompt graphs of every padded size a step of this budget can take (captured while their
        # first step runs): serving then never stops for a capture (gc, empty_cache, a sync).
        sizes = self.prompt_graph_tokens
        top = (padded_batch(n, sizes) or sizes[-1]) if sizes else 0
        for rows in (r for r in sizes if r <= top):
            k = min(rows, n)
            self.execute(StepPlan([entry(ids[0], [0] * k, 0, 0, greedy_and_sampled[0])], k, "grouped", [], []))
            if hybrid_rows(rows, self._hybrid_moe) and k > 1 and len(ids) > 1:
                # the mixed steps' own graph of this size: a chunk and a decode (mixed_moe_gemms)
                self.execute(StepPlan([entry(ids[0], [0] * (k - 1), 0, 0, greedy_and_sampled[0]),
                                       entry(ids[1], [0], n, 1, greedy_and_sampled[0])], k, "grouped", [], []))
                self.inputs.forget(StepPlan([], 0, "fused", [], ids[:2]))
        for params in greedy_and_sampled:
            plans = [StepPlan([entry(ids[0], [0] * n, 0, 0, params)], n, "grouped", [], []), decodes(ids[:1], params)]
            if len(ids) > self.limits.fused_max_batch:
                plans.append(decodes(ids, params))
            for plan in plans:
                self.execute(plan)
            self.inputs.forget(StepPlan([], 0, "fused", [], ids))
        # Every other grouped decode size the ring slots allow, greedy and sampled: captured during
        # serving, each would stall the loop as the batch grows (and add its objects to the heap
        # after the server froze it for the garbage collector, api/gc_pauses.py), as vLLM avoids.
        limit = min(slots, (padded_batch(max_num_seqs, self.grouped_batch_sizes) if max_num_seqs else None) or slots)
        for size in (b for b in self.grouped_batch_sizes[1:] if b <= limit):
            batch = [f"warm-up-{i}" for i in range(size)]
            for params in greedy_and_sampled:
                self.execute(decodes(batch, params))
            self.inputs.forget(StepPlan([], 0, "fused", [], batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """The launched step's tokens on the host (waits for the GPU to reach them)."""
        result = launched.collect()
        if self.timeline is not None:
            if launched.start is not None and launched.done is not None:
                self.timeline.collected(launched.start, launched.done, launched.prompt)
            else:                                     # sampled on the host: the launch waited for the GPU
                self.timeline.lose_track()
        return result

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Run the step on the GPU without waiting for it (unless its sampling needs the host)."""
        start = self.timeline.begin() if self.timeline is not None and plan.scheduled_requests else None
        launched = self._launch(plan)
        launched.start, launched.prompt = start, not plan.is_decode_only
        return launched

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        entries = plan.scheduled_requests
        self.inputs.forget(plan)
        if self.grammars is not None:
            self.grammars.forget(plan.finished_request_ids)
        if plan.ring_copies:                          # prefix-cache snapshots and restores, before any write
            self.kv.copy_rings(plan.ring_copies)
        if not entries:
            return LaunchedStep(result=StepResult({}))
        # a decode-only plan whose entries all sample (the common case) is its own decode list: no
        # per-entry property calls before the graph replay, which the GPU waits for in a synchronous step
        if plan.is_decode_only and all(map(_SAMPLES, entries)):
            decodes = entries
        else:
            decodes = [e for e in entries if e.num_tokens == 1 and e.samples]
        graph = self._decode_graph(len(decodes), plan.path == "fused") if decodes else None
        if graph is None:
            return self.sampled.record(*self._prompt(entries))
        if len(decodes) == len(entries):
            return self.sampled.record(*self._decode(entries, *graph))
        if len(decodes) < MIXED_SPLIT_MIN_DECODES and max(e.start_position for e in decodes) < ONE_FORWARD_MAX_CONTEXT:
            return self.sampled.record(*self._prompt(entries))
        # A mixed step with a long decode (or many): its decode rows replay their graph, its prompt
        # chunks run after it. The requests are disjoint, so the order of the two parts does not matter.
        prompts = [e for e in entries if not (e.num_tokens == 1 and e.samples)]
        b = len(decodes)
        first = self._decode(decodes, *self._decode_graph(b, b <= self.limits.fused_max_batch))
        if first[1] is not None:                      # the static buffers the prompt part may reuse
            first = (first[0], first[1].clone(), first[2])
        first_logits = self.last_logits.clone()
        second = self._prompt(prompts)
        done = first[0] + second[0]
        where = {e.request_id: row for row, e in enumerate(done)}
        # NOTE: not `logits[list]`: torch copies a host index to the GPU with a stream sync, which
        # would make the host wait for both parts before it prepares the next step (async scheduling)
        order = torch.tensor([where[e.request_id] for e in entries if e.samples], dtype=torch.long)
        self.last_logits = torch.cat([first_logits, self.last_logits]).index_select(
            0, order.to(self.device, non_blocking=True))
        if first[2] is None and second[2] is None:
            return self.sampled.record(done, torch.cat([first[1], second[1]]))
        first_result, second_result = (self._on_host(*part) for part in (first, second))
        logprobs = {**(first_result.logprobs or {}), **(second_result.logprobs or {})}
        return self.sampled.record(done, None, StepResult({**first_result.sampled_token_ids,
                                                           **second_result.sampled_token_ids}, logprobs or None,
                                                          second_result.prompt_logprobs))

    @staticmethod
    def _on_host(entries: list, tokens: torch.Tensor | None, result: StepResult | None) -> StepResult:
        if result is not None:
            return result
        return one_token_each([e.request_id for e in entries], tokens.tolist())

    def _decode_graph(self, b: int, fused: bool) -> tuple[str, int] | None:
        """(variant, padded rows) of the graph for b decode rows, or None past the largest: the fused
        path up to FUSED_MAX_BATCH rows where the plan names it (the scheduler does for decode-only
        steps within `limits.fused_max_batch`; a mixed step's decode rows within it take it too)."""
        if fused and b <= FUSED_MAX_BATCH:
            return "fused", b
        rows = padded_batch(b, self.grouped_batch_sizes)
        return None if rows is None else ("grouped", rows)

    def _decode(self, entries: list, variant: str, rows: int) -> tuple:
        b = len(entries)
        # the graph's argmax only where a row takes it (_choose: greedy rows; an all-sampling step skips it)
        self.inputs.fill(entries, self.sampled.sources(entries), argmax=any(map(_GREEDY, entries)))
        ops = []   # built when a segment runs (a capture or eager launches), not before a replay

        def segment(first: int, last: int):
            if not ops:
                ops.append(KernelOps(self.weights, variant, rows, self.ws.hidden, self.ws.logits, self.ws.next_tokens,
                                     inputs=self.inputs))
            return forward(ops[0], self.config, first, last, self.layer_outputs)
        # A persistent fused step is a few launches: one graph (no launch time to hide behind a first one)
        persistent = variant == "fused" and kernel_ops.PERSISTENT
        segments = [(0, self.config.num_hidden_layers)] if persistent else self.graphs.segments
        if self.use_graphs:
            if self.layer_outputs is not None:
                raise RuntimeError("layer_outputs needs use_graphs=False")
            self.graphs.run((variant, rows, persistent), segment, segments=segments)
        else:
            for first, last in segments:
                segment(first, last)
        self.last_logits = self.ws.logits[:b]
        return self._choose(entries, self.ws.next_tokens[:b], graph_sampler=self.use_graphs)

    def _prompt(self, entries: list) -> tuple:
        """Prompt chunks (or more decodes than any graph): one forward over all their rows, from a
        graph of the padded row count where one fits (`_prompt_graph`), else eager launches."""
        chunks = [Chunk(e.start_position, e.num_tokens, e.ring_slot, e.block_table) for e in entries]
        if self.use_graphs and self.layer_outputs is None and not prompt_spans(entries):
            rows = padded_batch(sum(e.num_tokens for e in entries), self.prompt_graph_tokens)
            if rows is not None:
                apart = kernel_ops.DECODES_APART and entries[0].num_tokens == 1
                static = self._prompt_buffers(rows, apart)
                if static[0].fits(chunks):
                    return self._prompt_graph(entries, chunks, rows, apart, *static)
        # NOTE: built on the host and copied without blocking: torch.tensor(..., device=cuda) copies
        # with a stream sync, which would make the host wait for the previous step before launching
        # this one (pageable memory is staged at once, so the lists are free when this returns).
        ids, samples = prompt_rows(entries)
        token_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        sample_rows = torch.tensor(samples, dtype=torch.long).to(self.device, non_blocking=True)
        self._feed(entries, token_ids)
        prefill = prefill_metadata(chunks, self.kv.block_size, self.kv.window, self.device, ring_rows=self.kv.ring_rows,
                                   max_decodes=self.ws.max_rows if kernel_ops.DECODES_APART else 0)
        sampling = [e for e in entries if e.samples]
        spans = prompt_spans(entries)        # rows of requests that ask for prompt logprobs
        if spans:
            extra = torch.tensor(logprob_rows(spans), dtype=torch.long, device=self.device)
            sample_rows = torch.cat([sample_rows, extra])
        c, t, n, m = self.config, token_ids.numel(), len(sampling), sample_rows.numel()
        # Logits in the workspace where they fit: the graph sampler draws from there, so a sampled
        # step keeps the host from waiting for the GPU (host sampling would read the logits back).
        shared = self.use_graphs and m <= self.ws.max_rows
        ops = KernelOps(self.weights, "prompt", t,
                        torch.empty(2, t, c.hidden_size, dtype=torch.bfloat16, device=self.device),
                        self.ws.logits[:m] if shared else torch.empty(m, c.vocab_size, dtype=torch.bfloat16,
                                                                      device=self.device),
                        self.ws.next_tokens[:m] if shared else torch.empty(m, dtype=torch.int64, device=self.device),
                        token_ids=token_ids, prefill=prefill, sample_rows=sample_rows,
                        moe_gemms=mixed_moe_gemms(entries, t, self._hybrid_moe))
        logits = forward(ops, c, layer_outputs=self.layer_outputs)
        self.last_logits = logits[:n]
        chosen = self._choose(sampling, ops.next_tokens[:n], graph_sampler=shared)
        if not spans:
            return chosen
        result = self._on_host(*chosen)
        result.prompt_logprobs = prompt_logprobs(logits[n:], entries, spans)
        return sampling, None, result

    def _feed(self, entries: list, token_ids: torch.Tensor) -> None:
        """The first token of each entry fed from the previous step's samples, on the device."""
        sources = self.sampled.sources(entries)
        starts = itertools.accumulate((e.num_tokens for e in entries), initial=0)
        fed = [(row, source) for row, source in zip(starts, sources) if source >= 0]
        self.sampled.resolve(token_ids, [row for row, _ in fed], [source for _, source in fed])

    def _prompt_buffers(self, rows: int, apart: bool) -> tuple:
        """The static inputs of the prompt graphs of `rows` rows: metadata buffers for up to as many
        entries as the logits buffer has rows (`apart`: their leading decodes on the decode kernel,
        DECODES_APART; steps without decodes keep graphs without those launches), and views of buffers
        shared by every size (the graphs never run at once): hidden state, token ids, sample rows,
        block tables."""
        kv = self.kv
        max_entries = min(self.ws.max_rows, kv.ring.shape[2])
        if self._prompt_shared is None:
            c, top = self.config, max(self.prompt_graph_tokens)
            width = -(-self.max_model_len // kv.block_size) + 1
            self._prompt_shared = (torch.zeros(2, top, c.hidden_size, dtype=torch.bfloat16, device=self.device),
                                   torch.zeros(top, dtype=torch.long, device=self.device),
                                   torch.zeros(max_entries, dtype=torch.long, device=self.device),
                                   torch.zeros(max_entries, width, dtype=torch.int32, device=self.device))
        static = self._prompt_static.get((rows, apart))
        if static is None:
            hidden, ids, samples, tables = self._prompt_shared
            entries = min(rows, max_entries)
            buffers = PrefillBuffers(rows, entries, tables.shape[1], kv.block_size, kv.window, kv.ring_rows,
                                     self.device, block_tables=tables, max_decodes=entries if apart else 0)
            static = (buffers, hidden[:, :rows], ids[:rows], samples[:entries])
            self._prompt_static[rows, apart] = static
        return static

    def _prompt_graph(self, entries: list, chunks: list, rows: int, apart: bool, buffers: PrefillBuffers,
                      hidden: torch.Tensor, token_ids: torch.Tensor, sample_rows: torch.Tensor) -> tuple:
        """A prompt step from the graph of `rows` padded rows: its inputs copied into the static
        buffers (padding: see PrefillBuffers), then replayed; the first step of a size runs eagerly
        while its graph is captured."""
        buffers.fill(chunks)
        ids, samples = prompt_rows(entries)
        n = len(samples)
        token_ids[:len(ids)].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        sample_rows.copy_(torch.tensor(samples + [0] * (sample_rows.numel() - n), dtype=torch.long),
                          non_blocking=True)          # padding: row 0 (in range; its logits unread)
        self._feed(entries, token_ids)
        gemms = mixed_moe_gemms(entries, rows, self._hybrid_moe)
        ops = KernelOps(self.weights, "prompt", rows, hidden, self.ws.logits, self.ws.next_tokens,
                        token_ids=token_ids, prefill=buffers.meta, sample_rows=sample_rows, num_rows=buffers.num_tokens,
                        moe_gemms=gemms)
        # steps with decodes apart, and mixed steps' expert GEMMs: graphs of their own
        key = ("prompt", rows, *(("decodes",) if apart else ()), *((gemms,) if gemms is not None else ()))
        self.graphs.run(key, lambda first, last: forward(ops, self.config, first, last), replay_first=False)
        self.last_logits = self.ws.logits[:n]
        # The logits and greedy ids sit where the graph sampler reads them: sampled rows draw on the
        # device too, so a sampled prompt step makes the host wait no more than a greedy one.
        return self._choose([e for e in entries if e.samples], self.ws.next_tokens[:n], graph_sampler=True)

    def _choose(self, entries: list, greedy_tokens: torch.Tensor, graph_sampler: bool) -> tuple:
        """(entries, tokens on the device, None) or (entries, None, a StepResult on the host): one token per
        entry from `last_logits` (its rows in entry order): the greedy ids the step computed on the GPU,
        the graph sampler's draw (decode rows), or executor/sampler.py (host work: seeds, edits, logprobs)."""
        if all(e.sampling_params.is_greedy and plain(e) for e in entries):
            return entries, greedy_tokens, None
        if graph_sampler and all(plain(e) and e.sampling_params.seed is None for e in entries):
            return entries, self.sampler(entries), None
        return entries, None, sampled_step(self.last_logits.float(), entries, self.eos_token_ids, self.generator,
                                             self.grammars)
