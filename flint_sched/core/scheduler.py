"""Continuous batching over a per-step token budget, in the manner of vLLM v1 (no torch).

Each step takes running decodes, then running prefill chunks, then waiting requests in arrival
order (preempted ones first), within max_num_batched_tokens tokens and max_num_seqs requests.
Every scheduled request holds blocks for all positions up to the end of its chunk; when blocks run
out, the newest running request is preempted (recompute). update() takes the plans in the order
schedule() made them; a plan may be made while earlier ones still run (async scheduling: at most one
plan ahead), and then a running decode's token is PLACEHOLDER_TOKEN, the one the earlier plan samples.

    index             0  1  2  3  4  5  6  7  8
    all_token_ids     p0 p1 p2 p3 p4 p5 o0 o1 o2     prompt p0..p5, output o0..o2
    KV written        [=====================]        num_computed_tokens = 8
    decode step                               [o2]   token_ids = all[8:9], start_position = 8
    after preemption  num_computed_tokens = 0, so all[0:9] is recomputed like a prompt (in
                      chunks); only the chunk that ends with o2 samples.
    async             the plan with [o2] still runs (in flight: 1 token, 1 pending output); the
                      next plan feeds position 9 with PLACEHOLDER_TOKEN, o3 being unknown here.

With prefix caching (core/prefix_cache.py) an admitted request starts at its hit, not at 0, and a
prefill chunk that crosses the prompt's snapshot position stops there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from flint_sched.core.kv_allocator import HybridKVAllocator, KVAllocation
from flint_sched.core.plan import PLACEHOLDER_TOKEN, RequestStepOutput, ScheduledRequest, StepPlan, StepResult
from flint_sched.core.prefix_cache import NO_HIT, PrefixCache
from flint_sched.core.request import FinishReason, Request, RequestStatus
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.sampling_params import SamplingParams

_RUNNING = RequestStatus.RUNNING


class _StepBuilder:
    """The plan being built: entries by request id (so a preempted one can be taken back)."""

    __slots__ = ("budget", "entries", "preempted_request_ids", "ring_copies")

    def __init__(self, budget: int, ring_copies: list[tuple[int, int]]) -> None:
        self.budget = budget
        self.entries: dict[str, ScheduledRequest] = {}
        self.preempted_request_ids: list[str] = []
        self.ring_copies = ring_copies

    def add(self, request: Request, num_new_tokens: int, allocation: KVAllocation, admitted: bool = False) -> None:
        start = request.num_computed_tokens + request.num_in_flight_tokens
        end = start + num_new_tokens
        token_ids = request.all_token_ids[start:end]
        if len(token_ids) < num_new_tokens:          # fed by a plan still running (async scheduling)
            token_ids += [PLACEHOLDER_TOKEN] * (num_new_tokens - len(token_ids))
        samples = end == len(request.all_token_ids) + request.num_pending_outputs
        self.entries[request.request_id] = ScheduledRequest(
            request.request_id,
            token_ids,
            start,
            allocation.block_table,
            allocation.ring_slot,
            samples,
            request.sampling_params,
            request.prompt_token_ids,
            request.output_token_ids,
            admitted and request.num_preemptions > 0,
        )
        request.num_in_flight_tokens += num_new_tokens
        request.num_pending_outputs += samples
        self.budget -= num_new_tokens

    def take_back(self, request: Request) -> None:
        """Drop the request's entry of this plan, if it has one (it is being preempted)."""
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self.budget += len(entry.token_ids)


class Scheduler:
    """Owns the waiting queue, the running set and the KV allocator; see the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_allocator = HybridKVAllocator(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            num_ring_slots=config.max_num_seqs,
            sliding_window=config.sliding_window,
            num_ring_snapshots=config.num_ring_snapshots if config.enable_prefix_caching else 0,
        )
        self.prefix_cache = (
            PrefixCache(self.kv_allocator, config.prefix_cache_key, min_shared_tokens=config.sliding_window)
            if config.enable_prefix_caching else None
        )
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._finished_since_plan: list[str] = []
        self._num_arrivals = 0

    @property
    def num_waiting_requests(self) -> int:
        return len(self._waiting)

    @property
    def num_running_requests(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
    ) -> Request:
        """Queue a request; ValueError if it could never run.

        Rejected: a duplicate id, an empty prompt, a prompt of max_model_len tokens or more (there
        must be room for one output token), and a request whose longest possible KV
        (min(prompt + max_tokens, max_model_len) - 1 positions: the last sampled token is never
        fed back) needs more blocks than the whole pool, so a lone request always fits.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens, "
                f"max_model_len is {self.config.max_model_len} (prompt + output must fit)"
            )
        request = Request(
            request_id,
            prompt_token_ids,
            sampling_params,
            eos_token_ids,
            arrival_index=self._num_arrivals,
            max_model_len=self.config.max_model_len,
        )
        num_blocks_needed = self.kv_allocator.num_blocks_for(request.max_num_tokens - 1)
        if num_blocks_needed > self.config.num_blocks:
            raise ValueError(
                f"request {request_id!r} may need {num_blocks_needed} KV blocks, "
                f"the pool has {self.config.num_blocks}: lower max_tokens"
            )
        self._num_arrivals += 1
        self._requests[request_id] = request
        self._waiting.append(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Finish with "abort" and free everything; False if no such unfinished request."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, finish_reason: FinishReason | str) -> bool:
        """Finish now (stop strings, aborts) and free everything; False if already finished."""
        reason = FinishReason(finish_reason)
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason)
        return True

    def schedule(self) -> StepPlan:
        """Choose this step's requests and chunks, allocating (or preempting) as needed."""
        cache = self.prefix_cache
        step = _StepBuilder(self.config.max_num_batched_tokens, cache.take_snapshot_copies() if cache else [])
        prefilling: list[Request] = []
        for request in list(self._running.values()):
            if request.status is not _RUNNING:
                continue
            if cache is not None and request.num_in_flight_tokens:    # async scheduling
                cache.snapshot_in_flight(request, self.kv_allocator.get(request.request_id), step.ring_copies)
            num_left = _num_left(request)
            if num_left == 1:
                self._schedule_running(request, 1, step)
            elif num_left > 1:
                prefilling.append(request)
        for request in prefilling:
            if request.status is _RUNNING and step.budget > 0:
                self._schedule_running(request, self._prompt_chunk(_num_left(request), step), step)
        if not step.preempted_request_ids:
            self._admit_waiting(step)

        entries = list(step.entries.values())
        num_tokens = self.config.max_num_batched_tokens - step.budget
        is_fused = (
            len(entries) <= self.config.fused_max_seqs
            and num_tokens == len(entries)
            and all(entry.samples for entry in entries)
        )
        finished_request_ids, self._finished_since_plan = self._finished_since_plan, []
        return StepPlan(
            entries,
            num_tokens,
            "fused" if is_fused else "grouped",
            step.preempted_request_ids,
            finished_request_ids,
            step.ring_copies,
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestStepOutput]:
        """Advance by the plan and the sampled tokens; one output per request that sampled.

        Entries of requests finished since schedule() (aborts, stop strings) are skipped.
        """
        outputs: list[RequestStepOutput] = []
        cache, block_size = self.prefix_cache, self.config.block_size
        sampled = result.sampled_token_ids
        logprobs = result.logprobs
        running = self._running
        for entry in plan.scheduled_requests:
            request = running.get(entry.request_id)
            if request is None:
                continue
            num_tokens = len(entry.token_ids)
            request.num_in_flight_tokens -= num_tokens
            request.num_pending_outputs -= entry.samples
            if request.num_computed_tokens != entry.start_position:
                raise RuntimeError(
                    f"stale plan for request {entry.request_id!r}: it has "
                    f"{request.num_computed_tokens} computed tokens, the plan starts at "
                    f"{entry.start_position} (each plan is updated once, in order)"
                )
            new_token_ids = sampled.get(entry.request_id) if entry.samples else None
            if entry.samples and not new_token_ids:
                raise ValueError(f"StepResult has no sampled token for {entry.request_id!r}")
            request.num_computed_tokens += num_tokens
            if cache is not None and (
                not entry.samples or request.num_computed_tokens // block_size > request.num_keyed_blocks
            ):  # a chunk that samples never ends at a snapshot position: only filled blocks matter
                cache.computed(request, self.kv_allocator.get(entry.request_id))
            if not entry.samples:
                continue
            reason = None
            for count, token_id in enumerate(new_token_ids, 1):
                reason = request.append_output_token(token_id)
                if reason is not None:
                    new_token_ids = new_token_ids[:count]
                    self._finish(request, reason)
                    break
            outputs.append(
                RequestStepOutput(
                    entry.request_id,
                    new_token_ids,
                    reason,
                    request.stop_reason,
                    None if logprobs is None else logprobs.get(entry.request_id),
                    request.num_cached_tokens or 0,
                )
            )
        return outputs

    def _prompt_chunk(self, num_left: int, step: _StepBuilder) -> int:
        """Prompt tokens a request may take this step: what is left of the budget, and at most
        long_prefill_token_threshold (when set) so that one long prompt does not fill a step that
        running decodes wait for."""
        threshold = self.config.long_prefill_token_threshold
        return min(num_left, step.budget, threshold) if threshold else min(num_left, step.budget)

    def _chunk_end(self, request: Request, start: int, num_new_tokens: int) -> int:
        end = start + num_new_tokens
        if self.prefix_cache is None or num_new_tokens == 1:     # one token never crosses a snapshot position
            return end
        return self.prefix_cache.chunk_end(request, start, end)

    def _schedule_running(self, request: Request, num_new_tokens: int, step: _StepBuilder) -> None:
        start = request.num_computed_tokens + request.num_in_flight_tokens
        end = self._chunk_end(request, start, num_new_tokens)
        allocator = self.kv_allocator
        while not allocator.can_allocate(request.request_id, end):
            if self._preempt_newest(step) is request:
                return
        step.add(request, end - start, allocator.allocate(request.request_id, end))

    def _admit_waiting(self, step: _StepBuilder) -> None:
        allocator, cache = self.kv_allocator, self.prefix_cache
        while self._waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            # a request that wants its prompt's logprobs computes every position (vLLM skips the cache too)
            hit = NO_HIT if cache is None or request.sampling_params.prompt_logprobs is not None else cache.find(request)
            if cache is not None:
                cache.admit(request, hit)
            start = hit.num_tokens
            end = self._chunk_end(request, start, self._prompt_chunk(len(request.all_token_ids) - start, step))
            if not allocator.can_allocate(request.request_id, end, hit.blocks):
                return
            self._waiting.popleft()
            request.status = _RUNNING
            self._running[request.request_id] = request
            allocation = allocator.allocate(request.request_id, end, hit.blocks)
            request.num_computed_tokens = start
            request.num_keyed_blocks = len(hit.blocks)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = start
            if cache is not None:
                cache.count(request.num_tokens, start)
            if hit.snapshot_slot is not None:
                step.ring_copies.append((hit.snapshot_slot, allocation.ring_slot))
            step.add(request, end - start, allocation, admitted=True)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and ring snapshot (vLLM's reset_prefix_cache); False when
        prefix caching is off. Requests running keep what they hold."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.reset()
        return True

    def _preempt_newest(self, step: _StepBuilder) -> Request:
        """Recompute-preempt the most recently admitted running request, even one in this plan."""
        request_id, request = self._running.popitem()
        self.kv_allocator.free(request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_in_flight_tokens = request.num_pending_outputs = 0
        request.num_keyed_blocks = 0
        request.num_preemptions += 1
        self._waiting.appendleft(request)
        step.take_back(request)
        step.preempted_request_ids.append(request_id)
        return request

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request_id = request.request_id
        if request.status is _RUNNING:
            del self._running[request_id]
            self.kv_allocator.free(request_id)
        else:
            self._waiting.remove(request)
        request.finish(reason)
        del self._requests[request_id]
        self._finished_since_plan.append(request_id)


def _num_left(request: Request) -> int:
    """Tokens still to feed: the known ones past what is computed or in flight, plus the pending
    outputs; 0 when the in-flight plans end the request by length (its last token is pending)."""
    total = len(request.all_token_ids) + request.num_pending_outputs
    if request.num_pending_outputs and total >= request.max_num_tokens:
        return 0
    return total - request.num_computed_tokens - request.num_in_flight_tokens
