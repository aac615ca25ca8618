"""Serving-benchmark arithmetic on recorded timings, no I/O: per request TTFT, ITL, TPOT and E2E latency; their
mean, median, std (population) and percentiles (linear interpolation, numpy's default); request, output and total
token throughput; goodput against SLOs. Times are seconds in and out; `summarize` reports milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutcome:
    """What one request recorded (perf_counter seconds). `token_times_s` holds the arrival of each streamed chunk
    that carried generated text (content, reasoning or tool-call arguments), in order."""

    success: bool
    start_s: float = 0.0
    end_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage when given, else the dataset's estimate
    usage_output_tokens: int | None = None  # the server's usage; None: count chunks
    error: str = ""
    turn: int | None = None  # the agent dataset's turn (0: a session's first request)
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens, when given

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s) if self.usage_output_tokens is None else self.usage_output_tokens


@dataclass(frozen=True)
class RequestLatency:
    ttft_s: float
    e2el_s: float
    itls_s: tuple[float, ...]
    tpot_s: float | None  # None with fewer than two output tokens


def request_latency(outcome: RequestOutcome) -> RequestLatency:
    """TTFT: first token chunk - start. ITL: gaps between token chunks. TPOT: (e2e - ttft) / (output_tokens - 1)."""
    times = outcome.token_times_s
    ttft = times[0] - outcome.start_s
    e2el = outcome.end_s - outcome.start_s
    n = outcome.output_tokens
    return RequestLatency(ttft, e2el, tuple(b - a for a, b in zip(times, times[1:])),
                          (e2el - ttft) / (n - 1) if n > 1 else None)


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile of ascending values, interpolating linearly between the closest ranks."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def summarize(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """{"mean", "median", "std", "p90", ...} in milliseconds; NaN for no values."""
    values = sorted(v * 1000 for v in values_s)
    if not values:
        return {"mean": math.nan, "median": math.nan, "std": math.nan} | {_pname(p): math.nan for p in percentiles}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "median": percentile(values, 50), "std": std} | {
        _pname(p): percentile(values, p) for p in percentiles}


def _pname(p: float) -> str:
    return f"p{p:g}"


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_METRICS)}; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0")
    return slos


def meets_slos(latency: RequestLatency, slos_ms: dict[str, float]) -> bool:
    """Every given SLO holds (value <= SLO); a request with one output token has a TPOT of 0."""
    values_ms = {"ttft": latency.ttft_s * 1000, "e2el": latency.e2el_s * 1000, "tpot": (latency.tpot_s or 0.0) * 1000}
    return all(values_ms[name] <= slo for name, slo in slos_ms.items())


@dataclass(frozen=True)
class BenchmarkMetrics:
    duration_s: float
    completed: int
    failed: int
    errors: dict[str, int]  # failure reason -> count
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    request_goodput: float | None  # requests meeting every SLO / s; None without SLOs
    summaries: dict[str, dict[str, float]]  # "ttft" | "tpot" | "itl" | "e2el" -> summarize()
    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    tpots_s: list[float]
    itls_s: list[float]
    e2els_s: list[float]
    ttft_by_turn: dict[int, dict[str, float]] = field(default_factory=dict)  # turn -> summarize() + count
    ttft_later_turns: dict[str, float] | None = None  # summarize() of TTFTs from the second turn on
    cached_tokens: int | None = None  # sum of usage cached_tokens; None when no response gave it


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float, percentiles: tuple[float, ...] = (90, 99),
                    slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Throughputs divide by `duration_s`, the benchmark's wall time. A successful request without any token
    chunk is counted as failed."""
    done = [o for o in outcomes if o.success and o.token_times_s]
    errors = Counter(o.error or "no tokens streamed" for o in outcomes if not (o.success and o.token_times_s))
    latencies = [request_latency(o) for o in done]
    ttfts = [lat.ttft_s for lat in latencies]
    tpots = [lat.tpot_s for lat in latencies if lat.tpot_s is not None]
    itls = [gap for lat in latencies for gap in lat.itls_s]
    e2els = [lat.e2el_s for lat in latencies]
    input_lens = [o.prompt_tokens for o in done]
    output_lens = [o.output_tokens for o in done]
    per_s = 1 / duration_s if duration_s > 0 else math.nan
    good = sum(meets_slos(lat, slos_ms) for lat in latencies) if slos_ms else None
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    turns = sorted({o.turn for o in done if o.turn is not None})
    by_turn = {}
    for t in turns:
        ttfts_of_turn = [lat.ttft_s for o, lat in zip(done, latencies) if o.turn == t]
        by_turn[t] = summarize(ttfts_of_turn, percentiles) | {"count": len(ttfts_of_turn)}
    later = [lat.ttft_s for o, lat in zip(done, latencies) if o.turn is not None and o.turn >= 1]
    cached = [o.cached_tokens for o in done if o.cached_tokens is not None]
    return BenchmarkMetrics(
        duration_s=duration_s, completed=len(done), failed=len(outcomes) - len(done), errors=dict(errors),
        total_input_tokens=sum(input_lens), total_output_tokens=sum(output_lens),
        request_throughput=len(done) * per_s, output_throughput=sum(output_lens) * per_s,
        total_token_throughput=(sum(input_lens) + sum(output_lens)) * per_s,
        request_goodput=None if good is None else good * per_s,
        summaries={name: summarize(values[name], percentiles) for name in LATENCY_METRICS},
        input_lens=input_lens, output_lens=output_lens, ttfts_s=ttfts, tpots_s=tpots, itls_s=itls, e2els_s=e2els,
        ttft_by_turn=by_turn, ttft_later_turns=summarize(later, percentiles) if turns else None,
        cached_tokens=sum(cached) if cached else None)
