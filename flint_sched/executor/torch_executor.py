"""TorchExecutor: runs a StepPlan with torch ops on any device (the portable path, CI's ground).

All tokens of the step (prefill chunks and decodes of many requests) go through `forward` with
`TorchOps` (executor/torch_ops.py); only the last token of a sampling entry reaches the LM head
(and the prompt tokens of a request that asks for prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from flint_sched.checkpoint.common import Weights
from flint_sched.config import FlintConfig
from flint_sched.core.plan import ScheduledRequest, StepPlan, StepResult, fill_placeholders
from flint_sched.executor.forward import forward
from flint_sched.executor.grammar_masks import GrammarMasks
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.executor.prompt_logprobs import prompt_logprobs
from flint_sched.executor.sampler import sampled_step
from flint_sched.executor.torch_ops import StepRows, TorchOps
from flint_sched.model.reference import FlintReference
from flint_sched.quant.nvfp4 import NVFP4Tensor


def dense_weights(weights: Weights, dtype: torch.dtype, device: torch.device) -> Weights:
    """Dequantize NVFP4 weights once; fp32 tensors (the correction bias) stay fp32."""
    out = {}
    for name, w in weights.items():
        if isinstance(w, NVFP4Tensor):
            out[name] = w.to(device).dequantize(dtype)
        else:
            out[name] = w.to(device, torch.float32 if w.dtype == torch.float32 else dtype)
    return out


class TorchExecutor:
    grammars: GrammarMasks | None = None           # structured outputs; set by the engine builder
    limits = ExecutorLimits(fused_max_batch=0)      # no fused path: every step is one torch forward

    def __init__(self, config: FlintConfig, weights: Weights, kv_cache: KVCache, eos_token_ids: Collection[int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0):
        self.config = config
        self.device = torch.device(device)
        self.model = FlintReference(config, dense_weights(weights, dtype, self.device), dtype, self.device)
        self.kv = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Set to a list to receive each layer's output hidden state [T, hidden] of the next steps.
        self.layer_outputs: list[torch.Tensor] | None = None
        self._last_tokens: dict[str, int] = {}      # what the last step sampled: feeds placeholders

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        if self.grammars is not None:
            self.grammars.forget(plan.finished_request_ids)
        entries = plan.scheduled_requests
        if plan.ring_copies:
            self.kv.copy_rings(plan.ring_copies)
        if not entries:
            return StepResult({})
        fill_placeholders(entries, self._last_tokens)
        rows = StepRows.from_entries(entries, self.device)
        logits = forward(TorchOps(self.model, self.kv, rows), self.config, layer_outputs=self.layer_outputs)
        sampling = [e for e in entries if e.samples]
        result = self.sample(logits[:len(sampling)], sampling) if sampling else StepResult({})
        if rows.prompt_spans:
            result.prompt_logprobs = prompt_logprobs(logits[len(sampling):], entries, rows.prompt_spans)
        self._last_tokens = {rid: tokens[-1] for rid, tokens in result.sampled_token_ids.items()}
        return result

    # Async scheduling (engine/async_engine.py): the step runs in launch, so collect has nothing to wait for.
    def launch(self, plan: StepPlan) -> StepResult:
        return self.execute(plan)

    def collect(self, launched: StepResult) -> StepResult:
        return launched

    def sample(self, logits: torch.Tensor, entries: list[ScheduledRequest]) -> StepResult:
        """One token per entry from its fp32 logits row (one batched pass, one read-back)."""
        return sampled_step(logits, entries, self.eos_token_ids, self.generator, self.grammars)
