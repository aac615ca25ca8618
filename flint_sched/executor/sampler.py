"""Token choice from one step's logits, for the whole batch at once, in vLLM's order.

    grammar mask -> allowed_token_ids -> bad words -> min_tokens mask -> logit_bias
    -> repetition / frequency / presence penalties -> (greedy: argmax) -> temperature -> top_k
    -> top_p -> min_p -> draw
The grammar mask (structured outputs, executor/grammar_masks.py) comes first, as in vLLM, so
logprobs see it too. The grammar and allowed_token_ids are hard masks; a row that the bans after
them (bad words, min_tokens) leave without any token keeps the hard-masked logits (a finished
grammar's only token is the stop token min_tokens bans).
Every transformation runs on the [B, V] logits as a few batched tensor operations (on the GPU when
the logits are there); the host reads back only the chosen ids (and logprobs, if asked for), in
one transfer. Logprobs come from the raw logits. A seeded request draws from a generator seeded by
(seed, number of tokens it has produced) and is filtered on its own row alone, so its output
depends on nothing else in the batch, nor on preemption.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

import torch

from flint_sched.core.plan import ScheduledRequest, StepResult, TokenLogprobs
from flint_sched.executor.grammar_masks import GrammarMasks, constrained
from flint_sched.sampling_params import SamplingParams


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) % 2**63)


def _index(logits: torch.Tensor, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)


def _index_put(logits: torch.Tensor, rows: list[int], cols: list[int], values, accumulate: bool = False) -> None:
    if rows:
        values = torch.as_tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(_index(logits, rows, cols), values, accumulate=accumulate)


def allow_only(logits: torch.Tensor, entries: Sequence[ScheduledRequest]) -> torch.Tensor:
    """logits, or a copy where the rows of requests with allowed_token_ids keep only those tokens."""
    rows = [row for row, e in enumerate(entries) if e.sampling_params.allowed_token_ids is not None]
    if not rows:
        return logits
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    at, ids = [], []
    for n, row in enumerate(rows):
        allowed = entries[row].sampling_params.allowed_token_ids
        at.extend([n] * len(allowed)), ids.extend(allowed)
    keep[_index(logits, at, ids)] = True
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = out[index].masked_fill(~keep, float("-inf"))
    return out


def bad_word_bans(e: ScheduledRequest) -> set[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM's bad_words)."""
    out, banned = e.output_token_ids, set()
    for ids in e.sampling_params.bad_words_token_ids:
        n = len(ids) - 1
        if n == 0 or (len(out) >= n and tuple(out[len(out) - n:]) == ids[:n]):
            banned.add(ids[-1])
    return banned


def edit_logits(logits: torch.Tensor, entries: Sequence[ScheduledRequest], eos_token_ids: Collection[int]) -> list[int]:
    """In place, per row: bad-word and min_tokens bans (EOS and stop ids), logit_bias, then the
    penalties. Each kind is one scatter over the batch, built from the host-side token lists.
    Returns the rows that got bans."""
    ban, bias, rep, freq = ([], []), ([], [], []), ([], [], []), ([], [], [])
    for row, e in enumerate(entries):
        p = e.sampling_params
        banned = bad_word_bans(e) if p.bad_words_token_ids else set()
        if len(e.output_token_ids) < p.min_tokens:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            ban[0].extend([row] * len(banned))
            ban[1].extend(sorted(banned))
        for token, value in p.logit_bias.items():
            bias[0].append(row), bias[1].append(token), bias[2].append(value)
        if p.repetition_penalty != 1.0:
            seen = sorted(set(e.prompt_token_ids) | set(e.output_token_ids))
            rep[0].extend([row] * len(seen)), rep[1].extend(seen), rep[2].extend([p.repetition_penalty] * len(seen))
        if e.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            for token, count in sorted(Counter(e.output_token_ids).items()):
                freq[0].append(row), freq[1].append(token)
                freq[2].append(-(p.frequency_penalty * count + p.presence_penalty))
    _index_put(logits, *ban, float("-inf"))
    _index_put(logits, *bias, accumulate=True)
    if rep[0]:
        index = _index(logits, rep[0], rep[1])
        values, penalty = logits[index], torch.tensor(rep[2], dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, torch.where(values > 0, values / penalty, values * penalty))
    _index_put(logits, *freq, accumulate=True)
    return sorted(set(ban[0]))


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (removed tokens get -inf), row by row of
    logits [n, V] with each row's own parameters, in a few batched operations."""
    vocab, dev = logits.shape[1], logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
    rows = torch.tensor([[p.temperature for p in params], top_k, top_p, min_p], dtype=torch.float32, device=dev)
    return filter_rows(logits, *rows, use_top_k=min(top_k) < vocab, use_top_p=min(top_p) < 1.0,
                       use_min_p=max(min_p) > 0.0)


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, use_top_k: bool = True, use_top_p: bool = True,
                use_min_p: bool = True) -> torch.Tensor:
    """`filter_logits` on parameter tensors [n] (fp32; top_k V, top_p 1 and min_p 0 keep every
    token), with no host work: a CUDA graph can hold it. The use_ flags skip masks no row needs."""
    logits = logits / temperature[:, None]
    if use_top_k or use_top_p:
        # Stable: ties keep vocabulary order, so the top-p boundary does not depend on the batch.
        values, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        if use_top_k:                # keep every value >= the k-th largest (its ties too)
            kth = values.gather(1, top_k.long()[:, None] - 1)
            values = values.masked_fill(values < kth, float("-inf"))
        if use_top_p:                # keep the tokens before the cumulative mass reaches p, and that one
            probs = torch.softmax(values, dim=-1)
            limit = torch.where(top_p < 1.0, top_p, float("inf"))[:, None]
            values = values.masked_fill(torch.cumsum(probs, dim=-1) - probs >= limit, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, values)
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [n, V]: argmax of probs / Exp(1) noise (the exponential race)."""
    return torch.argmax(probs / torch.empty_like(probs).exponential_(generator=generator), dim=-1)


def sample_batch(logits: torch.Tensor, entries: Sequence[ScheduledRequest], eos_token_ids: Collection[int],
                 generator: torch.Generator | None,
                 grammars: GrammarMasks | None = None) -> list[tuple[int, TokenLogprobs | None]]:
    """The next token (and its logprobs, if asked for) of each request from fp32 logits [B, V]."""
    filled = None
    if any(constrained(e) for e in entries):
        if grammars is None:
            raise RuntimeError("a request has structured outputs, but this executor has no grammar masks")
        filled = grammars.fill(entries)     # host work first: the device may still be running the step
        logits = grammars.mask(logits, filled)
    raw = logits                     # logprobs read these
    masked = allow_only(logits, entries)
    logits = masked.clone()
    banned = edit_logits(logits, entries, eos_token_ids)
    if banned:                       # the bans may have taken the only tokens the hard masks leave
        index = torch.tensor(banned, device=logits.device)
        edited = logits[index]
        dead = torch.isneginf(edited).all(dim=-1, keepdim=True)
        logits[index] = torch.where(dead, masked[index], edited)
    chosen = torch.argmax(logits, dim=-1)
    sampled = [row for row, e in enumerate(entries) if not e.sampling_params.is_greedy]
    seeded = [row for row in sampled if entries[row].sampling_params.seed is not None]
    groups = [[row for row in sampled if entries[row].sampling_params.seed is None]] + [[row] for row in seeded]
    for rows in groups:
        if not rows:
            continue
        index = torch.tensor(rows, device=logits.device)
        probs = torch.softmax(filter_logits(logits[index], [entries[r].sampling_params for r in rows]), dim=-1)
        p = entries[rows[0]].sampling_params
        chosen[index] = draw(probs, generator if p.seed is None else
                             _seeded_generator(p.seed, len(entries[rows[0]].output_token_ids), logits.device))
    want = [row for row, e in enumerate(entries) if e.sampling_params.logprobs is not None]
    if not want:
        return [(token, None) for token in chosen.tolist()]
    logprobs = torch.log_softmax(raw[want].float(), dim=-1)
    top = max(entries[row].sampling_params.logprobs for row in want)
    picked = logprobs.gather(1, chosen[want][:, None])[:, 0]
    top_values, top_ids = torch.topk(logprobs, top, dim=-1) if top > 0 else (logprobs[:, :0], logprobs[:, :0])
    tokens, picked, top_values, top_ids = (chosen.tolist(), picked.tolist(), top_values.tolist(),
                                           top_ids.long().tolist())
    results: list[tuple[int, TokenLogprobs | None]] = [(token, None) for token in tokens]
    for n, row in enumerate(want):
        k = entries[row].sampling_params.logprobs
        results[row] = (tokens[row], TokenLogprobs(tokens[row], picked[n], list(zip(top_ids[n][:k],
                                                                                     top_values[n][:k]))))
    return results


def sampled_step(logits: torch.Tensor, entries: Sequence[ScheduledRequest], eos_token_ids: Collection[int],
                 generator: torch.Generator | None, grammars: GrammarMasks | None = None) -> StepResult:
    """The StepResult of `sample_batch`: one token per entry, logprobs where asked for."""
    tokens, logprobs = {}, {}
    sampled = sample_batch(logits, entries, eos_token_ids, generator, grammars)
    for entry, (token, lp) in zip(entries, sampled, strict=True):
        tokens[entry.request_id] = [token]
        if lp is not None:
            logprobs[entry.request_id] = [lp]
    return StepResult(tokens, logprobs or None)


def sample_one(logits: torch.Tensor, entry: ScheduledRequest, eos_token_ids: Collection[int],
               generator: torch.Generator | None) -> tuple[int, TokenLogprobs | None]:
    """The next token of one request from its fp32 logits [V]."""
    return sample_batch(logits.view(1, -1), [entry], eos_token_ids, generator)[0]
