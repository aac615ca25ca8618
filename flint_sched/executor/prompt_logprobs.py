"""Prompt logprobs (vLLM's `prompt_logprobs`): which rows of a prefill chunk need logits, and the
logprobs of the prompt tokens from them. Only requests that ask pay: their chunk rows join the LM
head's rows after the sampling rows; no other row's logits are computed.

    positions of a chunk   s ........................ e-1        (prompt: 0 .. P-1)
    row at position j      gives the distribution of token j+1, for j + 1 <= P - 1
    so rows                s .. min(e, P-1) - 1  ->  logprobs of prompt tokens s+1 .. min(e, P-1)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flint_sched.core.plan import PromptLogprobs, ScheduledRequest, TokenLogprobs

ROWS_PER_BLOCK = 512          # log-softmax rows at a time: [512, 151552] fp32 is 310 MB


def prompt_spans(entries: Sequence[ScheduledRequest]) -> list[tuple[int, int, int]]:
    """(entry index, first row of its chunk's logit rows within the step, number of rows) per
    entry that wants prompt logprobs from this chunk; rows count from the step's first token."""
    spans, start = [], 0
    for index, e in enumerate(entries):
        if e.sampling_params.prompt_logprobs is not None:
            count = min(e.end_position, len(e.prompt_token_ids) - 1) - e.start_position
            if count > 0:
                spans.append((index, start, count))
        start += e.num_tokens
    return spans


def prompt_rows(spans: list[tuple[int, int, int]]) -> list[int]:
    """The step rows whose logits the spans need, in span order."""
    return [row for _, first, count in spans for row in range(first, first + count)]


def prompt_logprobs(logits: torch.Tensor, entries: Sequence[ScheduledRequest],
                    spans: list[tuple[int, int, int]]) -> dict[str, PromptLogprobs]:
    """From logits [rows, V] of `prompt_rows(spans)` (in that order), per request: its prompt tokens'
    logprobs, ranks and top alternatives (as many as it asks for)."""
    results, row = {}, 0
    for index, _, count in spans:
        e = entries[index]
        first = e.start_position + 1
        targets = torch.tensor(e.prompt_token_ids[first: first + count], device=logits.device)
        chosen = []
        for a in range(0, count, ROWS_PER_BLOCK):
            chosen += _block(logits[row + a: row + min(count, a + ROWS_PER_BLOCK)], targets[a: a + ROWS_PER_BLOCK],
                             e.sampling_params.prompt_logprobs)
        results[e.request_id] = PromptLogprobs(first, chosen)
        row += count
    return results


def _block(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logprobs > picked[:, None]).sum(dim=-1) + 1
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprobs(t, lp, list(zip(ids, values)), rank)
            for t, lp, rank, ids, values in zip(targets.tolist(), picked.tolist(), ranks.tolist(),
                                                top_ids.tolist(), top_values.tolist(), strict=True)]
