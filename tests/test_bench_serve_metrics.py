"""`bench serve` without HTTP: metric arithmetic on hand-built timings, arrival statistics, the request driver with
a fake sender, and dataset generation."""

import asyncio
import json
import math
import time

import numpy as np
import pytest

from flint_sched.benchmarks.serve import datasets
from flint_sched.benchmarks.serve.load import CANCELLED_AT_DEADLINE, arrival_gaps_s, run_requests
from flint_sched.benchmarks.serve.metrics import (
    RequestLatency,
    RequestOutcome,
    compute_metrics,
    meets_slos,
    parse_goodput,
    percentile,
    request_latency,
    summarize,
)

# A: 4 token chunks, no usage. TTFT 100 ms, ITLs 50/100/50 ms, E2E 320 ms, TPOT (320-100)/3 ms.
REQ_A = RequestOutcome(True, start_s=10.0, end_s=10.32, token_times_s=[10.1, 10.15, 10.25, 10.3], prompt_tokens=10)
# B: 2 chunks but usage says 12 tokens. TTFT 200 ms, ITL 200 ms, E2E 420 ms, TPOT 220/11 = 20 ms.
REQ_B = RequestOutcome(True, start_s=0.0, end_s=0.42, token_times_s=[0.2, 0.4], prompt_tokens=20,
                       usage_output_tokens=12)
FAILED = RequestOutcome(False, error="HTTP 500 InternalServerError: boom")
EMPTY = RequestOutcome(True, start_s=0.0, end_s=0.1)


def test_request_latency():
    a = request_latency(REQ_A)
    assert a.ttft_s == pytest.approx(0.1) and a.e2el_s == pytest.approx(0.32)
    assert a.itls_s == pytest.approx((0.05, 0.1, 0.05))
    assert a.tpot_s == pytest.approx(0.22 / 3)
    b = request_latency(REQ_B)
    assert REQ_B.output_tokens == 12 and b.tpot_s == pytest.approx(0.02)
    one = request_latency(RequestOutcome(True, start_s=0.0, end_s=0.3, token_times_s=[0.25]))
    assert one.tpot_s is None and one.itls_s == ()


def test_percentile_by_hand_and_against_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 100) == 4.0 and percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        data = sorted(rng.exponential(size=n).tolist())
        for p in (1, 50, 90, 99, 99.9):
            assert percentile(data, p) == pytest.approx(np.percentile(data, p))


def test_summarize_in_ms():
    s = summarize([0.004, 0.001, 0.003, 0.002], (90, 99.9))
    assert s["mean"] == pytest.approx(2.5) and s["median"] == pytest.approx(2.5)
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std
    assert s["p90"] == pytest.approx(3.7) and s["p99.9"] == pytest.approx(3.997)
    assert all(math.isnan(v) for v in summarize([], (99,)).values())


def test_compute_metrics_totals_throughput_and_itl():
    m = compute_metrics([REQ_A, FAILED, REQ_B, EMPTY], duration_s=2.0, percentiles=(90,))
    assert (m.completed, m.failed) == (2, 2)
    assert m.errors == {"HTTP 500 InternalServerError: boom": 1, "no tokens streamed": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 16)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.total_token_throughput == pytest.approx(23.0)
    assert m.request_goodput is None
    assert m.summaries["ttft"]["mean"] == pytest.approx(150.0)
    assert m.summaries["tpot"]["median"] == pytest.approx((220 / 3 + 20) / 2)
    assert sorted(m.itls_s) == pytest.approx([0.05, 0.05, 0.1, 0.2])
    assert m.summaries["itl"]["mean"] == pytest.approx(100.0) and m.summaries["itl"]["median"] == pytest.approx(75.0)
    assert m.summaries["e2el"]["p90"] == pytest.approx(320 + 0.9 * 100)
    assert m.output_lens == [4, 12] and m.input_lens == [10, 20]


@pytest.mark.parametrize("slos, goodput", [
    ({"ttft": 250, "tpot": 50}, 0.5),  # A fails TPOT (73 ms)
    ({"ttft": 150}, 0.5),  # B fails TTFT (200 ms)
    ({"e2el": 1000}, 1.0),
    ({"ttft": 100, "tpot": 20, "e2el": 320}, 0.0),  # A's TPOT and B's TTFT miss
])
def test_goodput(slos, goodput):
    assert compute_metrics([REQ_A, REQ_B, FAILED], 2.0, slos_ms=slos).request_goodput == pytest.approx(goodput)


def test_parse_goodput_and_single_token_tpot():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {"ttft": 500, "tpot": 50, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert meets_slos(RequestLatency(0.1, 0.1, (), None), {"tpot": 0})


def test_zero_duration_and_no_requests():
    m = compute_metrics([], 0.0)
    assert m.completed == 0 and math.isnan(m.request_throughput) and math.isnan(m.summaries["ttft"]["mean"])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_keep_the_rate_and_burstiness_sets_the_variance(burstiness):
    rate = 5.0
    gaps = arrival_gaps_s(40_000, rate, burstiness, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(k, 1/(rate k)): variance 1/(k rate^2), so the squared coefficient of variation is 1/k.
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_poisson_arrivals_count_per_second():
    rate = 20.0
    arrivals = np.cumsum(arrival_gaps_s(40_000, rate, 1.0, np.random.default_rng(2)))
    counts = np.bincount(arrivals.astype(int))[:-1]  # whole seconds only
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() == pytest.approx(rate, rel=0.15)  # Poisson: variance equals mean


def test_infinite_rate_and_bad_values():
    assert not arrival_gaps_s(5, math.inf, 1.0, np.random.default_rng(0)).any()
    for rate, burstiness in ((0, 1), (1, 0), (-1, 1)):
        with pytest.raises(ValueError):
            arrival_gaps_s(3, rate, burstiness, np.random.default_rng(0))


async def test_driver_caps_concurrency_and_reports_every_request():
    in_flight, peak, done = 0, 0, []

    async def send(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestOutcome(True, start_s=start, end_s=time.perf_counter(), token_times_s=[start])

    requests = [datasets.BenchRequest(prompt=str(i)) for i in range(12)]
    outcomes, duration_s = await run_requests(requests, send, request_rate=math.inf, burstiness=1.0,
                                              max_concurrency=3, max_duration_s=10, rng=np.random.default_rng(0),
                                              on_done=done.append)
    assert len(outcomes) == len(done) == 12 and peak == 3
    assert duration_s >= 4 * 0.01


async def test_driver_follows_the_request_rate():
    starts = []

    async def send(request):
        starts.append(time.perf_counter())
        return RequestOutcome(True, start_s=starts[-1], end_s=starts[-1], token_times_s=[starts[-1]])

    requests = [datasets.BenchRequest(prompt="x")] * 30
    before_s = time.perf_counter()
    _, duration_s = await run_requests(requests, send, request_rate=100.0, burstiness=1.0, max_concurrency=None,
                                       max_duration_s=10, rng=np.random.default_rng(3))
    scheduled = np.cumsum(arrival_gaps_s(30, 100.0, 1.0, np.random.default_rng(3)))  # about 0.3 s in all
    assert np.all(np.array(starts) - before_s >= scheduled - 0.002)  # never early
    assert duration_s < scheduled[-1] + 1.0


async def test_driver_deadline_cancels_in_flight_and_drops_unsent():
    cancelled = []

    async def send(request):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(request)
            raise

    requests = [datasets.BenchRequest(prompt=str(i)) for i in range(5)]
    start = time.perf_counter()
    outcomes, _ = await run_requests(requests, send, request_rate=math.inf, burstiness=1.0, max_concurrency=2,
                                     max_duration_s=0.2, rng=np.random.default_rng(0))
    assert time.perf_counter() - start < 2
    assert len(cancelled) == 2 and [o.error for o in outcomes] == [CANCELLED_AT_DEADLINE] * 2


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.9])
def test_random_dataset_lengths_stay_within_the_range_ratio(ratio):
    requests = datasets.random_requests(np.random.default_rng(0), 300, 100, 40, ratio)
    low_in, high_in = math.floor(100 * (1 - ratio)), math.ceil(100 * (1 + ratio))
    assert all(low_in <= r.prompt_len <= high_in for r in requests)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert all(math.floor(40 * (1 - ratio)) <= r.output_len <= math.ceil(40 * (1 + ratio)) for r in requests)
    if ratio:
        assert len({r.prompt_len for r in requests}) > 10
    assert len({r.prompt for r in requests}) == 300  # no shared prompts


def test_random_dataset_token_ids_and_seed():
    a = datasets.random_requests(np.random.default_rng(7), 20, 16, 8, 0.5, token_ids=True, vocab_size=500)
    b = datasets.random_requests(np.random.default_rng(7), 20, 16, 8, 0.5, token_ids=True, vocab_size=500)
    assert a == b
    assert all(len(r.prompt) == r.prompt_len and all(100 <= t < 500 for t in r.prompt) for r in a)
    with pytest.raises(ValueError):
        datasets.random_requests(np.random.default_rng(0), 1, 10, 10, 1.0)


def test_agent_history_grows_turn_by_turn():
    requests = datasets.agent_requests(np.random.default_rng(0), 10, num_turns=4, system_prompt_len=50,
                                       tool_result_len=30, output_len=64, range_ratio=0.25)
    assert len(requests) == 10 and [r.turn for r in requests] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert len({r.messages[0]["content"] for r in requests}) == 1  # one shared system prompt
    assert all(r.tools is datasets.AGENT_TOOLS for r in requests)
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:]):
            assert after.messages[: len(before.messages)] == before.messages
            assert len(after.messages) >= len(before.messages) + 2 and after.prompt_len > before.prompt_len
    last = requests[-1].messages
    assert [m["role"] for m in last[:3]] == ["system", "user", "assistant"] and last[-1]["role"] == "tool"
    for i, message in enumerate(last):
        if message["role"] == "assistant":
            ids = [call["id"] for call in message["tool_calls"]]
            assert [m["tool_call_id"] for m in last[i + 1:i + 1 + len(ids)]] == ids
            assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in message["tool_calls"])
    assert all(48 <= r.output_len <= 80 for r in requests)


def test_file_dataset(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_len": 7}\n\n"just a string"\n'
                     '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n')
    requests = datasets.file_requests(jsonl, 5, output_len=11)
    assert [r.output_len for r in requests] == [7, 11, 3, 7, 11]
    assert requests[0].prompt == "hello there" and requests[0].prompt_len == 2
    assert requests[2].messages == [{"role": "user", "content": "hi"}]
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n  \nsecond {not json}\n")
    assert [r.prompt for r in datasets.file_requests(text, 3, 5)] == ["first prompt", "second {not json}",
                                                                      "first prompt"]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.file_requests(tmp_path / "bad.jsonl", 1, 5)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError):
        datasets.file_requests(tmp_path / "empty.txt", 1, 5)


def test_ttft_by_turn_and_cached_tokens():
    def outcome(turn, ttft_s, cached):
        return RequestOutcome(True, start_s=0.0, end_s=1.0, token_times_s=[ttft_s], turn=turn, cached_tokens=cached)

    metrics = compute_metrics([outcome(0, 0.4, 0), outcome(0, 0.6, 0), outcome(1, 0.1, 64), outcome(2, 0.05, 128),
                               outcome(2, 0.07, 128)], duration_s=1.0)
    assert {t: s["median"] for t, s in metrics.ttft_by_turn.items()} == pytest.approx({0: 500, 1: 100, 2: 60})
    assert [s["count"] for s in metrics.ttft_by_turn.values()] == [2, 1, 1 + 1]
    assert metrics.ttft_later_turns["median"] == pytest.approx(70)
    assert metrics.cached_tokens == 320
    plain = compute_metrics([REQ_A, REQ_B], duration_s=1.0)
    assert plain.ttft_by_turn == {} and plain.ttft_later_turns is None and plain.cached_tokens is None


def test_prefix_cache_counters_from_metrics_text():
    from flint_sched.benchmarks.serve.server_metrics import hit_rate, parse_prefix_cache
    text = """# HELP flint:prefix_cache_queries_total Prefix cache queries
# TYPE flint:prefix_cache_queries_total counter
flint:prefix_cache_queries_total{model_name="m"} 1000.0
flint:prefix_cache_hits_total{model_name="m"} 600.0
flint:num_preemptions_total{model_name="m"} 3.0
"""
    assert parse_prefix_cache(text) == {"queries": 1000.0, "hits": 600.0}
    assert parse_prefix_cache(text.replace("flint:", "vllm:")) == {"queries": 1000.0, "hits": 600.0}
    assert parse_prefix_cache("flint:num_preemptions_total 3.0\n") is None
    rate = hit_rate({"queries": 200.0, "hits": 100.0}, {"queries": 1000.0, "hits": 600.0})
    assert rate == {"queries": 800.0, "hits": 500.0, "hit_rate": 0.625}
    assert hit_rate(None, {"queries": 1.0, "hits": 1.0}) is None
    assert math.isnan(hit_rate({"queries": 5.0, "hits": 0.0}, {"queries": 5.0, "hits": 0.0})["hit_rate"])
