"""Does one large request stall the server? `/health` latency and the gaps of a running stream, while
the largest requests the server accepts to prepare are sent again and again (and a 30 MiB one).

    python3 -m flint_sched.benchmarks.loop_stall --base-url http://127.0.0.1:8000 --duration 10

Phase "idle": only the probes run. Phase "large": the same probes while `--workers` clients send, in
turn, a /tokenize prompt just under the cheap length bound (the most text the server tokenizes), a
chat request rendering to as much, and a 30 MiB prompt (refused by the bound, after reading it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import numpy as np


async def health_probe(client: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        response = await client.get("/health")
        latencies.append(time.perf_counter() - start)
        assert response.status_code == 200
        await asyncio.sleep(0.01)


async def stream_probe(client: httpx.AsyncClient, stop: asyncio.Event, gaps: list[float]) -> None:
    body = {"prompt": "Tell a long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=body) as response:
            last = None
            async for line in response.aiter_lines():
                if not line:
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if stop.is_set():
                    break


def largest_requests(base_url: str, stop: threading.Event, num_chars: int, sent: list[int]) -> None:
    """In a thread, with bodies encoded once: the probes' loop in this process must not stall either."""
    text = ("flint " * (num_chars // 6 + 1))[:num_chars]
    bodies = [("/tokenize", {"prompt": text}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
              ("/tokenize", {"prompt": "flint " * (5 << 20)})]
    encoded = [(route, json.dumps(body).encode()) for route, body in bodies]
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        while not stop.is_set():
            for route, body in encoded:
                response = client.post(route, content=body, headers=headers)
                assert response.status_code < 500, response.text[:300]
                sent[0] += 1


def summary(name: str, values: list[float]) -> str:
    ms = np.array(values) * 1e3
    return (f"{name:>12}: n={len(ms):5d}  p50 {np.percentile(ms, 50):7.1f} ms  p99 {np.percentile(ms, 99):7.1f} ms"
            f"  max {ms.max():7.1f} ms")


async def phase(base_url: str, duration_s: float, workers: int, num_chars: int) -> None:
    stop, stop_senders = asyncio.Event(), threading.Event()
    latencies: list[float] = []
    gaps: list[float] = []
    sent = [0]
    senders = [threading.Thread(target=largest_requests, args=(base_url, stop_senders, num_chars, sent))
               for _ in range(workers)]
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        tasks = [asyncio.ensure_future(health_probe(client, stop, latencies)),
                 asyncio.ensure_future(stream_probe(client, stop, gaps))]
        await asyncio.sleep(1.0)                    # the stream is running before the senders start
        for sender in senders:
            sender.start()
        await asyncio.sleep(duration_s)
        stop.set()
        stop_senders.set()
        await asyncio.gather(*tasks)
    for sender in senders:
        sender.join()
    print(f"workers={workers} large requests answered={sent[0]}")
    print(summary("/health", latencies))
    print(summary("stream gaps", gaps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--workers", type=int, default=2, help="clients sending large requests")
    args = parser.parse_args()
    info = httpx.get(args.base_url + "/v1/models").json()["data"][0]
    from flint_sched.api.limits import max_chars_per_token
    from flint_sched.llm import LLM
    chars_per_token = max_chars_per_token(LLM(info["root"], device="cpu", progress=False).tokenizer)
    num_chars = chars_per_token * info["max_model_len"] - chars_per_token - 1      # just under the bound
    print(f"max_model_len {info['max_model_len']}, largest prepared prompt {num_chars} characters")
    for name, workers in (("idle", 0), ("large", args.workers)):
        print(f"-- {name}")
        asyncio.run(phase(args.base_url, args.duration, workers, num_chars))


if __name__ == "__main__":
    main()
