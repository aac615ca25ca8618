"""Token choice from one step's logits, per request, in vLLM's order.

    min_tokens mask -> logit_bias -> repetition / frequency / presence penalties -> (greedy: argmax)
    -> temperature -> top_k -> top_p -> min_p -> draw
Logprobs come from the raw logits. A seeded request draws from a generator seeded by (seed, number
of tokens it has produced), so its output depends on nothing else in the batch, nor on preemption.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from flint_sched.core.plan import ScheduledRequest, TokenLogprobs
from flint_sched.sampling_params import SamplingParams


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) % 2**63)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (removed tokens get -inf)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p     # keep the token that reaches p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, entry: ScheduledRequest, eos_token_ids: Collection[int],
               generator: torch.Generator | None) -> tuple[int, TokenLogprobs | None]:
    """The next token of one request from its fp32 logits [V]."""
    p = entry.sampling_params
    raw = logits
    logits = logits.clone()
    if len(entry.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
    for token_id, bias in p.logit_bias.items():
        logits[token_id] += bias
    logits = apply_penalties(logits, p, entry.prompt_token_ids, entry.output_token_ids)
    if p.is_greedy:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(filter_logits(logits, p), dim=-1)
        if p.seed is not None:
            generator = _seeded_generator(p.seed, len(entry.output_token_ids), logits.device)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        token = int(torch.argmax(probs / noise))
    if p.logprobs is None:
        return token, None
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    top = torch.topk(logprobs, p.logprobs) if p.logprobs > 0 else None
    top_list = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return token, TokenLogprobs(token, float(logprobs[token]), top_list)
