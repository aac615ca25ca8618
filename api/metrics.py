"""Prometheus metrics under the prefix `flint:`, with the names and meaning of vLLM's `vllm:` ones.

Gauges and the engine's counters come from one `engine.stats()` snapshot (engine/stats.py) at scrape
time, on the event loop. Token counters and latency histograms are fed by `observe` as outputs stream
by, as plain numbers on the event loop (StreamCollector: prometheus_client's own Counter and
Histogram take a lock and scan the buckets on every call, ~4 µs a streamed token); the queue time
(to the first step that runs the request) is the engine's, on its outputs.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable
from itertools import accumulate

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from flint_sched.engine.outputs import RequestOutput

PREFIX = "flint:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                     80.0, 160.0, 640.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                       5.0, 10.0, 20.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _one_sample(kind, name: str, doc: str, model_name: str, value: float):
    """A gauge or counter family (`kind`) of one sample labelled with the model's name."""
    family = kind(PREFIX + name, doc, labels=["model_name"])
    family.add_metric([model_name], float(value))
    return family


class EngineCollector:
    """Scrape-time gauges of the engine's state: requests, KV blocks, ring slots; the cache's
    configuration (vLLM's cache_config_info); counters of preemptions and of prefix-cache queries
    and hits (tokens)."""

    def __init__(self, get_engine: Callable, model_name: str):
        self.get_engine = get_engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        engine = self.get_engine()
        if engine is None:
            return
        stats = engine.stats()
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache block usage (full-attention layers); 1 means 100 percent.",
             stats.kv_block_usage),
            ("ring_slot_usage_perc", "Sliding-window ring slot usage; 1 means 100 percent.", stats.ring_slot_usage),
            ("num_kv_blocks_used", "KV-cache blocks in use.", stats.num_used_blocks),
            ("num_kv_blocks_total", "KV-cache blocks in the pool.", stats.num_total_blocks),
        )
        for name, doc, value in gauges:
            yield _one_sample(GaugeMetricFamily, name, doc, self.model_name, value)
        info = {"block_size": stats.block_size, "cache_dtype": stats.cache_dtype,
                "num_gpu_blocks": stats.num_total_blocks, "num_ring_slots": stats.num_ring_slots,
                "enable_prefix_caching": stats.enable_prefix_caching}
        family = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache's configuration.",
                                   labels=["model_name", *info])
        family.add_metric([self.model_name, *map(str, info.values())], 1.0)
        yield family
        counters = [
            ("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits),
        ]
        if stats.gpu is not None:                  # the CUDA executor's (executor/gpu_timeline.py)
            gpu = stats.gpu
            counters += [
                ("gpu_busy_seconds", "GPU time of the engine's steps (CUDA events; async scheduling).", gpu.busy_s),
                ("gpu_prompt_busy_seconds", "GPU time of the steps with prompt rows (part of gpu_busy_seconds).",
                 gpu.prompt_busy_s),
                ("gpu_idle_seconds", "Time the GPU waited for the host between consecutive steps while the "
                 "engine had work.", gpu.idle_s),
                ("gpu_stalled_seconds", "Time the GPU was idle while the engine held requests but scheduled "
                 "none.", gpu.stalled_s),
            ]
        for name, doc, value in counters:
            yield _one_sample(CounterMetricFamily, name, doc, self.model_name, value)


class _Histogram:
    """A histogram updated on the event loop without prometheus_client's locks and bucket scan (one
    observation a streamed token at hundreds of streams); exposed by StreamCollector at scrape time."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += count   # bucket i: value <= bounds[i]
        self.sum += value * count

    def family(self, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(PREFIX + self.name, self.doc, labels=["model_name"])
        cumulative = list(accumulate(self.counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([model_name], buckets, self.sum)
        return family


class StreamCollector:
    """The token counters and latency histograms `observe` feeds, as plain numbers until scraped."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {}       # finished_reason -> requests
        self.histograms: list[_Histogram] = []

    def histogram(self, name: str, doc: str, bounds: tuple[float, ...]) -> _Histogram:
        self.histograms.append(h := _Histogram(name, doc, bounds))
        return h

    def describe(self):
        return []

    def collect(self):
        for name, doc, value in (("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                                 ("generation_tokens", "Number of generation tokens processed.",
                                  self.generation_tokens)):
            yield _one_sample(CounterMetricFamily, name, doc, self.model_name, value)
        family = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed requests.",
                                     labels=["model_name", "finished_reason"])
        for reason, count in self.request_success.items():
            family.add_metric([self.model_name, reason], float(count))
        yield family
        for h in self.histograms:
            yield h.family(self.model_name)


class ServerMetrics:
    """The app's own registry (several apps may live in one process, as in tests)."""

    def __init__(self, model_name: str, get_engine: Callable):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, model_name))
        self.streams = c = StreamCollector(model_name)
        self.registry.register(c)
        self.model_name = model_name
        self.time_to_first_token = c.histogram("time_to_first_token_seconds", "Histogram of time to first token "
                                               "in seconds.", LATENCY_BUCKETS_S)
        self.inter_token_latency = c.histogram("inter_token_latency_seconds", "Histogram of inter-token latency "
                                               "in seconds.", TOKEN_GAP_BUCKETS_S)
        self.e2e_latency = c.histogram("e2e_request_latency_seconds", "Histogram of end to end request latency "
                                       "in seconds.", LATENCY_BUCKETS_S)
        self.queue_time = c.histogram("request_queue_time_seconds", "Histogram of time spent waiting in the "
                                      "queue in seconds.", LATENCY_BUCKETS_S)
        self.request_prompt_tokens = c.histogram("request_prompt_tokens", "Number of prefill tokens processed, "
                                                 "per request.", TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = c.histogram("request_generation_tokens", "Number of generation tokens "
                                                     "processed, per choice.", TOKEN_COUNT_BUCKETS)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, stream: AsyncIterator[RequestOutput], arrival: float,
                      num_prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        """Passes the outputs through, feeding the token counters and latency histograms (the queue
        time: the engine's, on the request's first output)."""
        first_token_seen = queue_time_seen = False
        last_token_time: dict[int, float] = {}
        streams = self.streams
        try:
            async for out in stream:
                now = time.perf_counter()
                if not queue_time_seen and out.queue_time_s is not None:
                    queue_time_seen = True
                    self.queue_time.observe(out.queue_time_s)
                for choice in out.outputs:
                    if not choice.delta_token_ids:
                        continue
                    n = len(choice.delta_token_ids)
                    streams.generation_tokens += n
                    if choice.index in last_token_time:   # n tokens at once (--stream-interval): n gaps
                        self.inter_token_latency.observe((now - last_token_time[choice.index]) / n, n)
                    last_token_time[choice.index] = now
                    if not first_token_seen:
                        first_token_seen = True
                        self.time_to_first_token.observe(now - arrival)
                        streams.prompt_tokens += num_prompt_tokens
                        self.request_prompt_tokens.observe(num_prompt_tokens)
                if out.finished:
                    self._on_finished(out, now - arrival)
                yield out
        finally:
            await stream.aclose()

    def _on_finished(self, out: RequestOutput, latency_s: float) -> None:
        self.e2e_latency.observe(latency_s)
        for choice in out.outputs:
            if choice.finish_reason != "abort":
                success = self.streams.request_success
                success[choice.finish_reason] = success.get(choice.finish_reason, 0) + 1
            self.request_generation_tokens.observe(len(choice.token_ids))
