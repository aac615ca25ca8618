"""A disconnect storm against a running server: many concurrent streams, a share of them dropped
mid-stream by the client, then the server's gauges read back once it is idle (issue 16).

    python3 -m flint_sched.benchmarks.disconnect_storm --base-url http://127.0.0.1:8000 \
        --concurrency 256 --requests 768 --drop-fraction 0.3

Prints (and with --output-json writes) the requests sent, completed, dropped, the HTTP statuses
seen (no 5xx is the goal), the wall time, and the running / waiting / KV / ring gauges once idle
(all zero is the goal: nothing leaked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

import httpx

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "ring_slot_usage_perc")


def gauges(metrics_text: str) -> dict[str, float]:
    values = {}
    for line in metrics_text.splitlines():
        for name in GAUGES:
            if line.startswith(f"flint:{name}{{") or line.startswith(f"flint:{name} "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, leave_after: int | None,
                     statuses: Counter) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            statuses[response.status_code] += 1
            if response.status_code != 200:
                await response.aread()
                return "error"
            lines = 0
            async for line in response.aiter_lines():
                lines += bool(line)
                if leave_after is not None and lines >= leave_after:
                    return "dropped"
            return "completed"
    except httpx.HTTPError as exc:
        statuses[type(exc).__name__] += 1
        return "error"


async def storm(args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        statuses: Counter = Counter()
        outcomes: Counter = Counter()
        gate = asyncio.Semaphore(args.concurrency)

        async def job() -> None:
            async with gate:
                words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(8, args.max_prompt_words)))
                drop = rng.random() < args.drop_fraction
                outcomes[await one_stream(client, model, words, args.max_tokens,
                                          rng.randint(2, args.max_tokens // 2) if drop else None, statuses)] += 1

        start = time.perf_counter()
        await asyncio.gather(*(job() for _ in range(args.requests)))
        wall_s = time.perf_counter() - start
        deadline, idle = time.monotonic() + args.idle_timeout, {}
        while time.monotonic() < deadline:
            idle = gauges((await client.get("/metrics")).text)
            if not any(idle.values()):
                break
            await asyncio.sleep(0.1)
        return {"requests": args.requests, "concurrency": args.concurrency, "outcomes": dict(outcomes),
                "statuses": {str(k): v for k, v in statuses.items()}, "wall_s": round(wall_s, 2), "idle_gauges": idle}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--requests", type=int, default=768)
    p.add_argument("--drop-fraction", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-words", type=int, default=200)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--idle-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    report = asyncio.run(storm(args))
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    server_errors = sum(v for k, v in report["statuses"].items() if k.isdigit() and int(k) >= 500)
    return 1 if server_errors or any(report["idle_gauges"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
