"""`flint-sched bench serve`: `add_arguments` declares the flags (spelled as `vllm bench serve` spells them) and
`run` builds the dataset, drives the endpoint once per swept `--max-concurrency` or `--request-rate` value,
prints the table and saves the JSON results and plots. Only loopback endpoints unless `--allow-remote`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
from tqdm import tqdm

from flint_sched.api.client import AsyncFlintClient
from flint_sched.api.client_types import FlintError
from flint_sched.benchmarks.serve import datasets, report
from flint_sched.benchmarks.serve.load import Target, run_requests, send_request
from flint_sched.benchmarks.serve.metrics import LATENCY_METRICS, compute_metrics, parse_goodput
from flint_sched.benchmarks.serve.server_metrics import hit_rate, scrape_prefix_cache

PROG = "flint-sched bench serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("endpoint")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (%(default)s)")
    p.add_argument("--endpoint", default="/v1/chat/completions",
                   help="/v1/chat/completions or /v1/completions (%(default)s); decides the API used")
    p.add_argument("--model", default=None, help="model name sent; default: the first one /v1/models lists")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --base-url that is not a loopback address. Refused by default because this is a "
                        "load generator: it opens many streams as fast as it can, which against a shared or paid "
                        "endpoint reached by mistake degrades it for others and can cost money")
    p = parser.add_argument_group("dataset")
    p.add_argument("--dataset-name", default="random", choices=("random", "agent", "file"))
    p.add_argument("--dataset-path", default=None, help="for --dataset-name file: .jsonl (objects with 'prompt' "
                   "or 'messages', optional 'output_len') or text with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests measured (%(default)s)")
    p.add_argument("--random-input-len", type=int, default=1024, help="tokens (words) per random prompt")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of random requests")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (%(default)s)")
    p.add_argument("--random-token-ids", action="store_true",
                   help="random prompts as token ids in [100, --random-vocab-size) (completions endpoint only)")
    p.add_argument("--random-vocab-size", type=int, default=4000)
    p.add_argument("--agent-num-turns", type=int, default=4, help="turns per agent session (%(default)s)")
    p.add_argument("--agent-system-prompt-len", type=int, default=1000, help="words in the shared system prompt")
    p.add_argument("--agent-tool-result-len", type=int, default=200, help="words per tool result")
    p.add_argument("--agent-output-len", type=int, default=128, help="max_tokens per agent turn")
    p.add_argument("--file-output-len", type=int, default=128, help="max_tokens when a file line gives none")
    p = parser.add_argument_group("load")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s (inf: all at once), or a comma list to sweep, e.g. 1,2,4 (%(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 is Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--max-concurrency", default=None,
                   help="most requests in flight, or a comma list to sweep, e.g. 1,4,16 (default: no cap)")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")
    p.add_argument("--max-duration", type=float, default=600.0,
                   help="seconds per run: then in-flight requests are cancelled and no more are sent")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM extension) to hit max_tokens")
    p.add_argument("--temperature", type=float, default=None, help="sent when given")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p = parser.add_argument_group("results")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, KEY in ttft, tpot, e2el, in ms, e.g. ttft:500 tpot:50")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="latencies shown in the table")
    p.add_argument("--metric-percentiles", default="90,99", help="percentiles reported (%(default)s)")
    p.add_argument("--save-result", action="store_true", help="write the JSON result and the PNG plots")
    p.add_argument("--result-dir", default=".", help="where --save-result writes (%(default)s)")
    p.add_argument("--result-filename", default=None, help="JSON file name; a sweep adds -PARAMVALUE to it")
    p.add_argument("--no-plot", action="store_true", help="with --save-result, skip the PNG plots")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_api(endpoint: str) -> tuple[str, str]:
    """("chat" | "completions", the API root's path): /v1/chat/completions -> ("chat", "/v1")."""
    path = "/" + endpoint.strip("/")
    for suffix, api in (("/chat/completions", "chat"), ("/completions", "completions")):
        if path.endswith(suffix) and path[: -len(suffix)].endswith("/v1"):
            return api, path[: -len(suffix)]
    raise ValueError(f"--endpoint must end in /v1/chat/completions or /v1/completions, got {endpoint!r}")


def parse_list(text: str | None, cast, flag: str) -> list:
    if text is None:
        return [None]
    try:
        values = [cast(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a number or a comma list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} values must be > 0, got {text!r}")
    return values


def build_requests(args: argparse.Namespace, api: str, num: int, rng: np.random.Generator):
    if args.dataset_name == "random":
        if args.random_token_ids and api != "completions":
            raise ValueError("--random-token-ids needs --endpoint /v1/completions")
        return datasets.random_requests(rng, num, args.random_input_len, args.random_output_len,
                                        args.random_range_ratio, args.random_token_ids, args.random_vocab_size)
    if args.dataset_name == "agent":
        if api != "chat":
            raise ValueError("--dataset-name agent needs --endpoint /v1/chat/completions")
        return datasets.agent_requests(rng, num, args.agent_num_turns, args.agent_system_prompt_len,
                                       args.agent_tool_result_len, args.agent_output_len, args.random_range_ratio)
    if not args.dataset_path:
        raise ValueError("--dataset-name file needs --dataset-path")
    requests = datasets.file_requests(args.dataset_path, num, args.file_output_len)
    if api == "completions" and any(r.messages is not None for r in requests):
        raise ValueError(f"{args.dataset_path} has 'messages' entries, which need --endpoint /v1/chat/completions")
    return requests


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    return extra


@dataclass(frozen=True)
class Plan:
    """Everything `run` needs, checked: made from the flags before any request is sent."""

    api: str
    api_root: str
    points: list[tuple[float, int | None]]  # (request rate, max concurrency) per run
    sweep: str | None  # "request_rate", "max_concurrency" or None
    percentiles: tuple[float, ...]
    slos_ms: dict[str, float]
    extra_body: dict[str, Any]
    metrics_shown: tuple[str, ...]
    warmups: list[datasets.BenchRequest]
    requests: list[datasets.BenchRequest]


def make_plan(args: argparse.Namespace) -> Plan:
    """Raises ValueError (or OSError reading --dataset-path) for anything wrong with the flags."""
    if not args.allow_remote and not is_loopback_url(args.base_url):
        raise ValueError(f"{args.base_url} is not a loopback address; pass --allow-remote to load-test it")
    api, api_path = endpoint_api(args.endpoint)
    rates = parse_list(args.request_rate, float, "--request-rate")
    concurrencies = parse_list(args.max_concurrency, int, "--max-concurrency")
    if len(rates) > 1 and len(concurrencies) > 1:
        raise ValueError("sweep either --request-rate or --max-concurrency, not both")
    if args.num_prompts < 1 or args.num_warmups < 0 or args.max_duration <= 0:
        raise ValueError("--num-prompts must be >= 1, --num-warmups >= 0 and --max-duration > 0")
    percentiles = tuple(parse_list(args.metric_percentiles, float, "--metric-percentiles"))
    if max(percentiles) > 100:
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles!r}")
    shown = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if not set(shown) <= set(LATENCY_METRICS):
        raise ValueError(f"--percentile-metrics takes a comma list of {','.join(LATENCY_METRICS)}")
    all_requests = build_requests(args, api, args.num_warmups + args.num_prompts, np.random.default_rng(args.seed))
    return Plan(
        api=api, api_root=args.base_url.rstrip("/") + api_path,
        points=[(rate, concurrency) for rate in rates for concurrency in concurrencies],
        sweep="request_rate" if len(rates) > 1 else "max_concurrency" if len(concurrencies) > 1 else None,
        percentiles=percentiles, slos_ms=parse_goodput(args.goodput), extra_body=_extra_body(args),
        metrics_shown=shown, warmups=all_requests[: args.num_warmups], requests=all_requests[args.num_warmups:])


def aiohttp_transport() -> httpx.AsyncBaseTransport | None:
    """httpx over aiohttp (httpx-aiohttp: its C HTTP parser), connections unlimited; None without
    it. At 256 streams httpx's own transport (h11 and anyio in Python, ~60 µs of client CPU per
    streamed event) held this client at a whole core, so it, not the server, set the pace
    (benchmarks/RESULTS.md, session 10)."""
    try:
        import aiohttp
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        return None

    class Transport(AiohttpTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            try:
                return await super().handle_async_request(request)
            except httpx.ConnectTimeout as e:
                # httpx-aiohttp 0.2 maps a refused connection (ClientConnectorError) to a timeout
                if isinstance(e.__cause__, aiohttp.ClientConnectorError):
                    raise httpx.ConnectError(str(e), request=request) from e.__cause__
                raise

    return Transport(client=lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))


async def _benchmark(args: argparse.Namespace, plan: Plan) -> list[tuple[str, dict]]:
    async with AsyncFlintClient(plan.api_root, args.api_key, max_retries=0, max_connections=None,
                                timeout=httpx.Timeout(args.max_duration + 30, connect=10.0),
                                transport=aiohttp_transport()) as client:
        model = args.model
        if model is None:
            listed = await client.models()
            if not listed:
                raise FlintError("the server lists no models; pass --model")
            model = listed[0].id
        target = Target(plan.api, model, args.ignore_eos, plan.extra_body)

        finished_turns: dict[tuple[int, int], asyncio.Event] = {}

        async def send(request):
            """An agent's turn t+1 goes after its turn t has finished (when both are in this run): the
            agent reads the answer first, and the next prompt can then hit the cache of the last one."""
            if request.session is None:
                return await send_request(client, target, request)
            previous = finished_turns.get((request.session, request.turn - 1))
            if previous is not None:
                await previous.wait()
            try:
                return await send_request(client, target, request)
            finally:
                finished_turns[(request.session, request.turn)].set()

        def expect_turns(requests):
            finished_turns.clear()
            finished_turns.update({(r.session, r.turn): asyncio.Event() for r in requests if r.session is not None})

        if plan.warmups:
            expect_turns(plan.warmups)
            outcomes, _ = await run_requests(plan.warmups, send, request_rate=math.inf, burstiness=1.0,
                                             max_concurrency=plan.points[0][1], max_duration_s=args.max_duration,
                                             rng=np.random.default_rng(args.seed))
            failed = sum(not o.success for o in outcomes)
            print(f"warm-up: {len(plan.warmups)} requests, {failed} failed", file=sys.stderr)
        runs = []
        for rate, concurrency in plan.points:
            label = f"rate {rate:g}/s" + (f", concurrency {concurrency}" if concurrency else "")
            expect_turns(plan.requests)
            cache_before = await scrape_prefix_cache(args.base_url)
            with tqdm(total=len(plan.requests), desc=label, unit="req", disable=args.disable_tqdm) as bar:
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                outcomes, duration_s = await run_requests(
                    plan.requests, send, request_rate=rate, burstiness=args.burstiness, max_concurrency=concurrency,
                    max_duration_s=args.max_duration, rng=np.random.default_rng(args.seed),
                    on_done=lambda _: bar.update())
                cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
            config = {"date": time.strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url, "endpoint": args.endpoint,
                      "endpoint_type": plan.api, "model": model, "dataset_name": args.dataset_name,
                      "num_prompts": len(plan.requests), "num_sent": len(outcomes), "request_rate": rate,
                      "burstiness": args.burstiness, "max_concurrency": concurrency, "ignore_eos": args.ignore_eos,
                      "num_warmups": len(plan.warmups), "max_duration": args.max_duration, "seed": args.seed,
                      "goodput_slos_ms": plan.slos_ms or None}
            cache = hit_rate(cache_before, await scrape_prefix_cache(args.base_url))
            metrics = compute_metrics(outcomes, duration_s, plan.percentiles, plan.slos_ms)
            result = report.build_result(config, metrics)
            # this process's CPU over the run: near 100 % the client, not the server, sets the pace
            result["client_cpu_percent"] = 100 * cpu_s / wall_s if wall_s > 0.1 else None
            if cache is not None:
                result |= {f"prefix_cache_{key}": value for key, value in cache.items()}
            runs.append((label, result))
        return runs


def _save(args: argparse.Namespace, runs: list[tuple[str, dict]], sweep: str | None) -> None:
    first = runs[0][1]
    rate = "rate-sweep" if sweep == "request_rate" else f"{first['request_rate']:g}qps"
    parts = ["flint-bench", args.dataset_name, rate]
    if sweep == "max_concurrency" or first["max_concurrency"]:
        parts.append("concurrency-sweep" if sweep == "max_concurrency" else f"concurrency{first['max_concurrency']}")
    name = args.result_filename or "-".join(parts + [first["model"].replace("/", "_"), first["date"]]) + ".json"
    base = Path(args.result_dir) / name
    for label, result in runs:
        path = base if sweep is None else base.with_name(f"{base.stem}-{sweep}{result[sweep]:g}{base.suffix}")
        report.write_json(path, result)
        print(f"wrote {path}", file=sys.stderr)
    if args.no_plot:
        return
    plots = [(base.with_name(base.stem + "-latency-cdf.png"), report.plot_latency_cdfs, (runs,))]
    if sweep is not None:
        plots.append((base.with_name(base.stem + "-sweep.png"), report.plot_sweep, ([r for _, r in runs], sweep)))
    for path, plot, plot_args in plots:
        if plot(path, *plot_args):
            print(f"wrote {path}", file=sys.stderr)
        else:
            print("plots skipped: matplotlib is not installed (pip install 'flint-sched[bench]')", file=sys.stderr)
            return


def run(args: argparse.Namespace) -> int:
    """Returns 0 when every run completed at least one request, 1 otherwise, 2 for invalid flags."""
    try:
        plan = make_plan(args)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        runs = asyncio.run(_benchmark(args, plan))
    except FlintError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    for _, result in runs:
        print(report.format_table(result, plan.metrics_shown))
    if plan.sweep is not None:
        print(report.format_sweep_table([r for _, r in runs], plan.sweep))
    if args.save_result:
        _save(args, runs, plan.sweep)
    return 0 if all(r["completed"] for _, r in runs) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
