"""Sending the benchmark's requests: gamma-distributed arrivals (Poisson at burstiness 1), an optional cap on
requests in flight, a `--max-duration` deadline, and one streamed request timed chunk by chunk. Requests not yet
sent at the deadline are dropped; requests in flight are cancelled (their connections closed) and count as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from flint_sched.api.client import AsyncFlintClient
from flint_sched.api.client_types import ChatCompletionChunk, Completion, FlintAPIError, FlintError
from flint_sched.benchmarks.serve.datasets import BenchRequest
from flint_sched.benchmarks.serve.metrics import RequestOutcome

CANCELLED_AT_DEADLINE = "cancelled: --max-duration reached"


def arrival_gaps_s(num: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds between consecutive arrivals: gamma(shape=burstiness, mean=1/rate), so the rate holds on average
    and the squared coefficient of variation is 1/burstiness (1: Poisson). An infinite rate sends all at once."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num)
    return rng.gamma(shape=burstiness, scale=1 / (request_rate * burstiness), size=num)


@dataclass(frozen=True)
class Target:
    """How to turn a `BenchRequest` into an HTTP request."""

    api: Literal["chat", "completions"]
    model: str
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def _has_tokens(chunk: ChatCompletionChunk | Completion) -> bool:
    if isinstance(chunk, Completion):
        return any(choice.text for choice in chunk.choices)
    return any(c.delta.content or c.delta.reasoning or c.delta.tool_calls for c in chunk.choices)


async def _open_stream(client: AsyncFlintClient, target: Target, request: BenchRequest):
    params: dict[str, Any] = dict(target.extra_body)
    if request.output_len is not None:
        params["max_tokens"] = request.output_len
    if target.ignore_eos:
        params["ignore_eos"] = True
    if target.api == "completions":
        return await client.completions(request.prompt, model=target.model, stream=True, **params)
    messages = request.messages or [{"role": "user", "content": request.prompt}]
    return await client.chat(messages, model=target.model, tools=request.tools, stream=True, **params)


async def send_request(client: AsyncFlintClient, target: Target, request: BenchRequest) -> RequestOutcome:
    """Streams one request and times each chunk that carries generated text; errors become a failed outcome."""
    outcome = RequestOutcome(success=False, prompt_tokens=request.prompt_len, start_s=time.perf_counter(),
                             turn=request.turn)
    try:
        async with await _open_stream(client, target, request) as stream:
            async for chunk in stream:
                now = time.perf_counter()
                if _has_tokens(chunk):
                    outcome.token_times_s.append(now)
                if chunk.usage is not None:
                    outcome.prompt_tokens = chunk.usage.prompt_tokens or outcome.prompt_tokens
                    outcome.usage_output_tokens = chunk.usage.completion_tokens
                    if chunk.usage.prompt_tokens_details is not None:
                        outcome.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
        outcome.success = True
    except FlintAPIError as e:
        outcome.error = f"HTTP {e.status} {e.type or 'error'}: {e.message[:200]}"
    except FlintError as e:
        outcome.error = f"{type(e).__name__}: {str(e)[:200]}"
    outcome.end_s = time.perf_counter()
    return outcome


async def run_requests(requests: list[BenchRequest], send: Callable[[BenchRequest], Awaitable[RequestOutcome]], *,
                       request_rate: float, burstiness: float, max_concurrency: int | None, max_duration_s: float,
                       rng: np.random.Generator,
                       on_done: Callable[[RequestOutcome], None] | None = None) -> tuple[list[RequestOutcome], float]:
    """Sends `requests` on the arrival schedule, at most `max_concurrency` at a time; returns the outcomes of the
    requests that were sent (in request order) and the wall time in seconds from the first send to the last end."""
    gaps = arrival_gaps_s(len(requests), request_rate, burstiness, rng)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    outcomes: list[RequestOutcome | None] = [None] * len(requests)
    loop = asyncio.get_running_loop()
    start_s = time.perf_counter()
    start_loop, deadline = loop.time(), loop.time() + max_duration_s

    async def one(index: int) -> None:
        async with limit:
            if loop.time() >= deadline:
                return
            try:
                outcomes[index] = await send(requests[index])
            except asyncio.CancelledError:
                outcomes[index] = RequestOutcome(success=False, error=CANCELLED_AT_DEADLINE)
                raise
        if on_done is not None:
            on_done(outcomes[index])

    async def dispatch(tasks: list[asyncio.Task]) -> None:
        arrival_s = 0.0
        for index, gap in enumerate(gaps):
            arrival_s += float(gap)
            await asyncio.sleep(max(0.0, start_loop + arrival_s - loop.time()))
            tasks.append(asyncio.create_task(one(index)))

    tasks: list[asyncio.Task] = []
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(dispatch(tasks), timeout=max_duration_s)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration_s = time.perf_counter() - start_s
    return [o for o in outcomes if o is not None], duration_s
