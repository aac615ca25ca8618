"""The asyncio engine: add_request / abort / a stream of RequestOutput, around one loop task.

    loop:  [execute N (worker thread)] -> update(N) -> schedule(N+1) -> [execute N+1] ...
                                                                     +-> post-process N (here)
The scheduler is touched only from the event loop; the executor runs in one worker thread, so the
CPU work of step N (detokenize, stop strings, streams) overlaps the model work of step N+1.

Async scheduling (an executor with launch/collect, `async_scheduling`): step N+1 is scheduled and
launched before step N's tokens are read back, so the GPU goes from one step to the next without
waiting for the host; a decode of N+1 is fed the token N samples on the device (PLACEHOLDER_TOKEN
in the plan). It is used while no request of step N reads its own output history when sampling
(penalties, min_tokens); a request that finishes in step N (eos, stop string) wastes its slot of
N+1, whose token is dropped. Blocks freed by update(N) may be reallocated to step N+2, which runs
after N+1 on the same stream, so N+1's writes never land in another request's blocks after it.
The read-back (`collect`) runs on a second thread and reads only what its launch returned, so N's
tokens never wait for launch(N+1) to return, which a launch that samples on the host (or the torch
executor's) does only once its step has run (a prompt's first token waited a whole extra step).
Late launch-ahead (`launch_margin_s` > 0): the step after the one running is planned not as soon
as that one starts but `launch_margin_s` before its expected end (the shortest of the last decode
steps), or at once when a request arrives: a request that arrives while a decode step runs then
joins the next step instead of the one after it (one decode step off its time to first token),
as long as the margin covers planning and launching. Only while the running step is decode-only.
Watchdog: a step running past `step_timeout_s` kills the loop (a hung GPU never returns); a dead
loop fails every request in flight, and `join()` tells its owner why, so the server can exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from flint_sched.core.plan import PromptLogprobs, RequestStepOutput, StepPlan, StepResult
from flint_sched.core.scheduler import Scheduler
from flint_sched.engine.output_processor import ChoiceState
from flint_sched.engine.output_queue import OutputQueue, stream_outputs
from flint_sched.engine.outputs import CompletionOutput, EngineError, RequestOutput
from flint_sched.engine.stats import EngineStats, GpuStats
from flint_sched.engine.step_worker import StepWorker
from flint_sched.sampling_params import SamplingParams, reads_history
from flint_sched.structured.compiler import GrammarCompiler
from flint_sched.tokenizer import FlintTokenizer

logger = logging.getLogger(__name__)
WORKER_JOIN_TIMEOUT_S = 2.0          # how long shutdown waits for the step in flight (a hung one: in vain)
# NOTE: the step thread needs the GIL to hand a finished step back and launch the next one, while
# this loop runs pure Python for every stream; at CPython's default switch interval (5 ms) it waited
# ~5.7 ms a step at 256 streams (benchmarks/bench_host.py: the gap between a step's end and the next
# step's start), at 0.2 ms ~1.7 ms. Set process-wide when the engine starts.
GIL_SWITCH_INTERVAL_S = 0.0002


def check_request(prompt_ids: list[int], p: SamplingParams, vocab_size: int, max_model_len: int,
                  grammar_compiler: GrammarCompiler) -> None:
    """ValueError for a request that can never run (the engine's admission, and the API process's
    before it sends one: engine/remote.py)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"this model's maximum context length is {max_model_len} tokens, but the "
                         f"prompt has {len(prompt_ids)}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if len(prompt_ids) + p.max_tokens > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{len(prompt_ids) + p.max_tokens} were requested ({len(prompt_ids)} in the prompt, "
            f"{p.max_tokens} for the completion)")
    bad_words = [t for ids in p.bad_words_token_ids for t in ids]
    for name, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids),
                      ("allowed_token_ids", p.allowed_token_ids or ()), ("bad_words_token_ids", bad_words)):
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{name} names token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
    if p.structured_outputs is not None:
        # ValueError for an invalid grammar; the server compiled it off the loop already (a cache hit)
        grammar_compiler.compile(p.structured_outputs)


def with_bad_words_tokenized(p: SamplingParams, tokenizer) -> SamplingParams:
    """`p` with its bad_words' token sequences added to bad_words_token_ids: each word as it starts
    a text and after a space (its two spellings in running text), as vLLM tokenizes them."""
    if not p.bad_words:
        return p
    sequences = dict.fromkeys(p.bad_words_token_ids)
    for word in p.bad_words:
        for spelling in (word.lstrip(), " " + word.lstrip()):
            sequences.setdefault(tuple(tokenizer.encode(spelling)))
    return dataclasses.replace(p, bad_words_token_ids=tuple(ids for ids in sequences if ids))


class StepTimeoutError(EngineError):
    """The watchdog: a step ran past the engine's step timeout."""


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    queue: OutputQueue                       # or a sink of another process's request (submit)
    choices: dict[str, ChoiceState] = field(default_factory=dict)   # scheduler id -> choice
    num_finished: int = 0
    # by every choice, so it is complete at each choice's first output (a stream's echo needs that)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    arrival: float = 0.0                  # perf_counter at add_request
    queue_time_s: float | None = None     # set when a step first runs one of its choices

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.choices)


class AsyncEngine:
    """Owns the scheduler and the executor; see the module docstring for the loop."""

    def __init__(self, scheduler: Scheduler, executor, tokenizer: FlintTokenizer, vocab_size: int,
                 step_timeout_s: float | None = None, async_scheduling: bool = False,
                 grammar_compiler: GrammarCompiler | None = None, launch_margin_s: float = 0.0,
                 stream_interval: int = 1):
        self.scheduler = scheduler
        self.executor = executor
        if async_scheduling and not (hasattr(executor, "launch") and hasattr(executor, "collect")):
            raise ValueError(f"async scheduling needs an executor with launch/collect, not {type(executor).__name__}")
        self.async_scheduling = async_scheduling
        if not launch_margin_s >= 0:
            raise ValueError(f"launch margin must be >= 0 seconds, got {launch_margin_s}")
        self.launch_margin_s = launch_margin_s       # 0: plan the next step as soon as one starts
        if not (isinstance(stream_interval, int) and stream_interval >= 1):
            raise ValueError(f"stream interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval       # publish a choice's output every this many tokens
        self._decode_s: deque[float] = deque(maxlen=4)  # recent decode-only steps' GPU time, back to back
        self._last_done = 0.0                       # when the last step's result came back
        self.tokenizer = tokenizer
        self.grammar_compiler = grammar_compiler or GrammarCompiler(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = scheduler.config.max_model_len
        self._requests: dict[str, _Request] = {}
        self._choice_owner: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self.step_timeout_s = step_timeout_s          # None or 0: no watchdog
        self._worker: StepWorker | None = None
        self._collector: StepWorker | None = None      # async scheduling: runs executor.collect
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.num_preemptions = 0
        self._unsent_drops: list[str] = []     # finished / preempted ids of plans never executed

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self._worker = StepWorker()
            if self.async_scheduling:
                self._collector = StepWorker("flint-collect")
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="flint-engine-loop")

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead_error is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    async def join(self) -> BaseException | None:
        """Waits until the loop ends: why it died, or None when it was shut down (or never started)."""
        task = self._task
        if task is not None:
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()                # retrieved here; dead_error says the same
        return self.dead_error

    async def shutdown(self) -> None:
        """Stop the loop, end every open stream with an error, free everything. A step still
        running (a hung one) is waited for only WORKER_JOIN_TIMEOUT_S: its thread is a daemon."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:                   # the loop had died; dead_error holds why, logged then
                pass
            self._task = None
        self._fail_all(EngineError("the engine was shut down"))
        for worker in (w for w in (self._worker, self._collector) if w is not None):
            worker.shutdown()
            if self.dead_error is None and not await asyncio.to_thread(worker.join, WORKER_JOIN_TIMEOUT_S):
                logger.warning("a step was still running %.0f s after shutdown", WORKER_JOIN_TIMEOUT_S)
        self._worker = self._collector = None

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (text or token ids); ValueError when it can never run."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._stream(self._admit(prompt_ids, params, request_id, OutputQueue()))

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str, sink) -> None:
        """Queue a request whose outputs go to `sink.put_nowait` (each RequestOutput, or the exception
        that ended it) instead of a stream; ValueError when it can never run. The API process's
        requests come in this way (engine/remote.py)."""
        self._admit(list(prompt_ids), params, request_id, sink)

    def _admit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, queue) -> _Request:
        if not self.is_running:
            raise EngineError(f"the engine is not running ({self.dead_error or 'not started'})")
        params = with_bad_words_tokenized(params, self.tokenizer)
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.grammar_compiler)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = _Request(request_id, prompt_ids, queue, arrival=time.perf_counter())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt_ids)
        one = dataclasses.replace(params, n=1)
        added = []
        try:
            for index in range(params.n):
                choice_id = request_id if params.n == 1 else f"{request_id}#{index}"
                choice_params = one if params.seed is None else dataclasses.replace(one, seed=params.seed + index)
                self.scheduler.add_request(choice_id, prompt_ids, choice_params, self.tokenizer.eos_token_ids)
                added.append(choice_id)
                request.choices[choice_id] = ChoiceState(index, choice_params, self.tokenizer)
        except ValueError:
            for choice_id in added:
                self.scheduler.abort_request(choice_id)
            raise
        self._requests[request_id] = request
        self._choice_owner.update({choice_id: request for choice_id in request.choices})
        self._wakeup.set()
        return request

    def _stream(self, request: _Request) -> AsyncIterator[RequestOutput]:
        return stream_outputs(request.queue, lambda: self.abort(request.request_id))

    def abort_all(self) -> int:
        """Finish every request now with "abort" (a drain that ran out of time); how many there were."""
        requests = list(self._requests.values())
        for request in requests:
            self._end(request, None)
        return len(requests)

    def abort(self, request_id: str) -> bool:
        """Finish a request now with "abort", freeing its blocks and ring slots."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._end(request, None)
        return True

    def _end(self, request: _Request, error: BaseException | None) -> None:
        """Free everything the request holds; its stream gets a final "abort" output, or the error."""
        self._requests.pop(request.request_id, None)
        for choice_id, choice in request.choices.items():
            self.scheduler.abort_request(choice_id)
            self._choice_owner.pop(choice_id, None)
            if choice.output.finish_reason is None:
                choice.fail("abort")
        request.num_finished = len(request.choices)
        outputs = [c.output.snapshot() for c in request.choices.values()]
        request.queue.put_nowait(error if error is not None else
                                 RequestOutput(request.request_id, request.prompt_token_ids, outputs, True,
                                               prompt_logprobs=request.prompt_logprobs,
                                               num_cached_tokens=request.num_cached_tokens))

    # -- the loop ------------------------------------------------------------------------------

    async def _loop(self) -> None:
        in_flight: deque[tuple[StepPlan, asyncio.Future, float]] = deque()
        try:
            while True:
                if not in_flight:
                    started = self._start_step()
                    if started is None:
                        if (timeline := self.gpu_timeline) is not None:   # the next gap is not the host's
                            timeline.break_chain(self.scheduler.has_unfinished_requests())
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    in_flight.append(started)
                plan, future, launched_at = in_flight[0]
                if len(in_flight) == 1 and self._may_run_ahead(plan):
                    await self._hold_ahead(plan, launched_at)
                    if (ahead := self._start_step()) is not None:
                        in_flight.append(ahead)
                try:
                    result: StepResult = await self._finish_step(future)
                except StepTimeoutError:
                    raise
                except Exception as e:  # a failing step fails its requests, the loop goes on
                    logger.exception("step failed")
                    self._fail_plan(plan, e)
                    in_flight.popleft()
                    continue
                in_flight.popleft()
                self._step_done(plan, launched_at)
                outputs = self.scheduler.update(plan, result)
                if result.prompt_logprobs:
                    self._collect_prompt_logprobs(result.prompt_logprobs)
                if not in_flight and (started := self._start_step()) is not None:
                    in_flight.append(started)
                self._process(outputs)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if isinstance(e, StepTimeoutError):
                logger.critical("the engine loop stops: %s", e)
            else:
                logger.exception("the engine loop died")
            self.dead_error = e
            self._fail_all(e if isinstance(e, StepTimeoutError) else EngineError(f"the engine loop died: {e!r}"))
            raise

    @property
    def gpu_timeline(self):
        """The executor's GPU busy / idle accounting (executor/gpu_timeline.py), or None."""
        return getattr(self.executor, "timeline", None)

    def stats(self) -> EngineStats:
        """The state /metrics reports, as one snapshot (engine/stats.py)."""
        scheduler, timeline = self.scheduler, self.gpu_timeline
        allocator, config, cache = scheduler.kv_allocator, scheduler.config, scheduler.prefix_cache
        kv = getattr(self.executor, "kv", None)
        e4m3 = kv is not None and str(kv.dtype) == "torch.float8_e4m3fn"
        return EngineStats(
            num_running=scheduler.num_running_requests, num_waiting=scheduler.num_waiting_requests,
            kv_block_usage=allocator.block_usage, ring_slot_usage=allocator.ring_slot_usage,
            num_used_blocks=allocator.num_used_blocks, num_total_blocks=allocator.num_total_blocks,
            block_size=config.block_size, cache_dtype="fp8_e4m3" if e4m3 else "auto",
            num_ring_slots=config.max_num_seqs + config.num_ring_snapshots,
            enable_prefix_caching=config.enable_prefix_caching, num_preemptions=self.num_preemptions,
            prefix_cache_queries=0 if cache is None else cache.num_queried_tokens,
            prefix_cache_hits=0 if cache is None else cache.num_hit_tokens,
            gpu=None if timeline is None else GpuStats(timeline.busy_s, timeline.prompt_busy_s, timeline.idle_s,
                                                       timeline.stalled_s))

    async def _hold_ahead(self, running: StepPlan, launched_at: float) -> None:
        """Late launch-ahead (module docstring): wait until `launch_margin_s` before the running
        decode step's expected end, or until a request arrives."""
        margin = self.launch_margin_s
        if not margin or not self._decode_s or not running.is_decode_only:
            return
        expected = min(self._decode_s)
        if expected < 2 * margin or self._wakeup.is_set():
            return
        delay = max(launched_at, self._last_done) + expected - margin - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(self._wakeup.wait(), delay)
            except TimeoutError:
                pass

    def _step_done(self, plan: StepPlan, launched_at: float) -> None:
        """A step's result is back: its GPU time when it ran right after the previous one."""
        now = time.perf_counter()
        if self.launch_margin_s and launched_at <= self._last_done and plan.is_decode_only:
            self._decode_s.append(now - self._last_done)
        self._last_done = now

    def _may_run_ahead(self, plan: StepPlan) -> bool:
        """Whether the next step may be scheduled before `plan`'s tokens are known: async scheduling
        is on and no request that samples in `plan` reads its output history to sample."""
        return self.async_scheduling and not any(e.samples and reads_history(e.sampling_params)
                                                 for e in plan.scheduled_requests)

    async def _finish_step(self, future: asyncio.Future) -> StepResult:
        """The step's result, or StepTimeoutError once it has run past the watchdog's limit."""
        if self.async_scheduling:
            launched = await self._watch(future)
            future = self._collector.submit(self.executor.collect, launched)
        return await self._watch(future)

    async def _watch(self, future: asyncio.Future):
        if not self.step_timeout_s:
            return await future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.step_timeout_s)
        except TimeoutError:
            raise StepTimeoutError(f"a step has not returned after {self.step_timeout_s:g} s (the engine "
                                   "iteration timeout); the executor is hung") from None

    def _start_step(self) -> tuple[StepPlan, asyncio.Future, float] | None:
        if not self.scheduler.has_unfinished_requests():
            return None
        self._wakeup.clear()            # arrivals from here on are not in this plan (_hold_ahead)
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted_request_ids)
        if plan.is_empty:   # not executed: the next plan tells the executor what to drop
            self._unsent_drops += plan.finished_request_ids + plan.preempted_request_ids
            return None
        if self._unsent_drops:
            plan.finished_request_ids[:0], self._unsent_drops = self._unsent_drops, []
        run = self.executor.launch if self.async_scheduling else self.executor.execute
        future, now = self._worker.submit(run, plan), time.perf_counter()
        for entry in plan.scheduled_requests:      # queue time: until the first step that runs the request
            request = self._choice_owner.get(entry.request_id)
            if request is not None and request.queue_time_s is None:
                request.queue_time_s = now - request.arrival
        return plan, future, now

    def _collect_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Store each chunk's prompt logprobs by position (a chunk recomputed after preemption rewrites
        the same values)."""
        for choice_id, chunk in chunks.items():
            request = self._choice_owner.get(choice_id)
            if request is not None and request.prompt_logprobs is not None:
                first = chunk.first_position
                request.prompt_logprobs[first: first + len(chunk.entries)] = chunk.entries

    def _process(self, outputs: list[RequestStepOutput]) -> None:
        for step in outputs:
            request = self._choice_owner.get(step.request_id)
            if request is None:
                continue
            choice = request.choices[step.request_id]
            request.num_cached_tokens = max(request.num_cached_tokens, step.num_cached_tokens)
            out = choice.apply(step)
            if choice.stopped_by_string and step.finish_reason is None:
                self.scheduler.finish_request(step.request_id, "stop")
            if out.finished:
                request.num_finished += 1
                self._choice_owner.pop(step.request_id, None)
            if not choice.due(self.stream_interval):
                continue
            choice.mark_published()
            self._publish(request, [out])

    def _publish(self, request: _Request, changed: list[CompletionOutput]) -> None:
        """Stream the changed choices; the last update carries every choice (unchanged: no delta)."""
        outputs = [c.snapshot() for c in changed]
        if request.finished:
            self._requests.pop(request.request_id, None)
            outputs += [dataclasses.replace(c.output, delta_text="", delta_token_ids=[],
                                            delta_logprobs=None if c.output.logprobs is None else [])
                        for c in request.choices.values() if c.output not in changed]
            outputs.sort(key=lambda c: c.index)
        request.queue.put_nowait(RequestOutput(request.request_id, request.prompt_token_ids, outputs,
                                               request.finished, prompt_logprobs=request.prompt_logprobs,
                                               num_cached_tokens=request.num_cached_tokens,
                                               queue_time_s=request.queue_time_s))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False when prefix caching is off."""
        return self.scheduler.reset_prefix_cache()

    def _fail_plan(self, plan: StepPlan, error: Exception) -> None:
        self.scheduler.reset_prefix_cache()         # the step may have left its ring copies undone
        failed = {self._choice_owner[e.request_id] for e in plan.scheduled_requests
                  if e.request_id in self._choice_owner}
        for request in failed:
            self._end(request, EngineError(f"step failed: {error!r}"))

    def _fail_all(self, error: Exception) -> None:
        for request in list(self._requests.values()):
            self._end(request, error)
