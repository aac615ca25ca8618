"""Prometheus metrics under the prefix `flint:`, with the names and meaning of vLLM's `vllm:` ones.

Gauges and the engine's counters come from one `engine.stats()` snapshot (engine/stats.py) at scrape
time, on the event loop. Token counters and latency histograms are fed by `observe` as outputs stream
by; the queue time (to the first step that runs the request) is the engine's, on its outputs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flint_sched.engine.outputs import RequestOutput

PREFIX = "flint:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                     80.0, 160.0, 640.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                       5.0, 10.0, 20.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


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
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
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
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


class ServerMetrics:
    """The app's own registry (several apps may live in one process, as in tests)."""

    def __init__(self, model_name: str, get_engine: Callable):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, **labels).labels(model_name)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.",
                                     **labels).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         **labels).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Histogram of time to first token "
                                             "in seconds.", LATENCY_BUCKETS_S)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Histogram of inter-token latency "
                                             "in seconds.", TOKEN_GAP_BUCKETS_S)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency "
                                     "in seconds.", LATENCY_BUCKETS_S)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent waiting in the "
                                    "queue in seconds.", LATENCY_BUCKETS_S)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed, "
                                               "per request.", TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Number of generation tokens "
                                                   "processed, per choice.", TOKEN_COUNT_BUCKETS)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, stream: AsyncIterator[RequestOutput], arrival: float,
                      num_prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        """Passes the outputs through, feeding the token counters and latency histograms (the queue
        time: the engine's, on the request's first output)."""
        first_token_seen = queue_time_seen = False
        last_token_time: dict[int, float] = {}
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
                    self.generation_tokens.inc(n)
                    if choice.index in last_token_time:   # n tokens at once (--stream-interval): n gaps
                        gap = (now - last_token_time[choice.index]) / n
                        for _ in range(n):
                            self.inter_token_latency.observe(gap)
                    last_token_time[choice.index] = now
                    if not first_token_seen:
                        first_token_seen = True
                        self.time_to_first_token.observe(now - arrival)
                        self.prompt_tokens.inc(num_prompt_tokens)
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
                self.request_success.labels(self.model_name, choice.finish_reason).inc()
            self.request_generation_tokens.observe(len(choice.token_ids))
