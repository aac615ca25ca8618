"""The server's life under stress, on scripted servers: a disconnect storm, a graceful shutdown
under load (SIGTERM: drain, abort, exit 0), and the step watchdog with a hung step (exit 1)."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from api_server import API_KEY, SCRIPTED_MODEL, own_server, shared_server, sse_events

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
EXIT_WAIT_S = 30.0           # a bound for "the process exits"; the tests never wait for it to pass


def chat(content: str, stream: bool, **extra) -> dict:
    return {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def gauges(metrics_text: str) -> dict[str, float]:
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "ring_slot_usage_perc")
    values = {}
    for line in metrics_text.splitlines():
        for name in names:
            if line.startswith(f"flint:{name}{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges((await client.get("/metrics")).text)
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


async def read_stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None,
                      leave_after: int | None = None) -> str | None:
    """The whole SSE body, or None when the client leaves after `leave_after` lines."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        text, lines = "", 0
        async for line in response.aiter_lines():
            text += line + "\n"
            lines += bool(line)
            if started is not None and lines >= 2:
                started.set()
            if leave_after is not None and lines >= leave_after:
                return None
        return text


def test_disconnect_storm_frees_every_block_and_slot(request):
    server = shared_server(request, "scripted")

    async def run():
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60, limits=limits) as c:
            body = chat("SLOW_STORY", True, ignore_eos=False)
            jobs = [read_stream(c, body, leave_after=3 if i % 10 < 3 else None) for i in range(64)]
            texts = await asyncio.gather(*jobs)
            return texts, await wait_idle(c)

    texts, idle = asyncio.run(run())
    assert idle == dict.fromkeys(idle, 0.0) and len(idle) == 4, idle
    kept = [t for t in texts if t is not None]
    assert len(kept) == 64 - 21
    for text in kept:
        events = sse_events(text)
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("reasoning") or d.get("content") or "" for d in deltas) == ("word " * 50).rstrip()
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def running_at_least(client: httpx.AsyncClient, num_requests: int) -> None:
    while gauges((await client.get("/metrics")).text)["num_requests_running"] < num_requests:
        await asyncio.sleep(0.02)


async def until_unhealthy(client: httpx.AsyncClient) -> None:
    """Until /health says 503 (draining) or the listener has closed."""
    while True:
        try:
            if (await client.get("/health")).status_code == 503:
                return
        except httpx.TransportError:
            return
        await asyncio.sleep(0.02)


def exited(server, timeout_s: float = EXIT_WAIT_S) -> int:
    return server.process.wait(timeout=timeout_s)


@pytest.mark.parametrize("processes", ["0", "1"], ids=["one-process", "api-process"])
def test_sigterm_drains_then_aborts_the_rest_and_exits_cleanly(request, processes):
    server = own_server(request, "drain", ["--api-key", API_KEY, "--served-model-name", SCRIPTED_MODEL,
                                            "--shutdown-timeout", "3", "--api-server-count", processes])

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as c:
            # The non-streamed request runs first: started after the streams, it could still be
            # waiting when the quick one (0.5 s after its first token) had already finished.
            full = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat("ENDLESS_STORY", False)))
            await asyncio.wait_for(running_at_least(c, 1), 30)
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(read_stream(c, chat(content, True), event))
                       for content, event in zip(("ENDLESS_STORY", "ENDLESS_STORY", "QUICK_ANSWER"), started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(until_unhealthy(c), 30)
            try:
                refused = await c.post("/v1/chat/completions", json=chat("PLAIN_ANSWER", False))
                assert refused.status_code == 503, refused.text
            except httpx.TransportError:
                pass                                    # the listener had closed: refused as well
            return await asyncio.gather(*streams), await full

    (endless_a, endless_b, quick), full = asyncio.run(run())
    for text in (endless_a, endless_b):
        events = sse_events(text)
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert sse_events(quick)[-1]["choices"][0]["finish_reason"] == "stop"
    assert full.status_code == 200 and full.json()["choices"][0]["finish_reason"] == "abort"
    assert exited(server) == 0
    assert "Traceback" not in server.log() and "aborted 3 request(s)" in server.log(), server.log()


@pytest.mark.parametrize("processes", ["0", "1"], ids=["one-process", "api-process"])
def test_a_hung_step_trips_the_watchdog_and_the_process_exits_1(request, processes):
    server = own_server(request, "watchdog", ["--api-key", API_KEY, "--served-model-name", SCRIPTED_MODEL,
                                               "--engine-iteration-timeout-s", "3", "--api-server-count", processes])

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as c:
            ok = await c.post("/v1/chat/completions", json=chat("PLAIN_ANSWER", False))
            assert ok.status_code == 200
            started = asyncio.Event()
            stream = asyncio.ensure_future(read_stream(c, chat("HUNG_GPU_STEP", True), started))
            await asyncio.wait_for(started.wait(), 30)
            full = await c.post("/v1/chat/completions", json=chat("PLAIN_ANSWER", False))
            try:
                health = (await c.get("/health")).status_code
            except httpx.TransportError:
                health = None                           # already gone
            return await stream, full, health

    text, full, health = asyncio.run(run())
    blocks = text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    error = json.loads(blocks[-3][len("data: "):])["error"]
    assert "has not returned after 3 s" in error["message"]
    # failed in flight (500), or refused when it came after the watchdog had fired (503)
    assert full.status_code in (500, 503) and "has not returned after 3 s" in full.json()["error"]["message"]
    assert health != 200
    assert exited(server) == 1


@pytest.mark.parametrize("processes", ["0", "1"], ids=["one-process", "api-process"])
def test_sigterm_ends_a_server_whose_step_hangs(request, processes):
    server = own_server(request, "hung-sigterm", ["--api-key", API_KEY, "--served-model-name", SCRIPTED_MODEL,
                                                   "--engine-iteration-timeout-s", "0", "--shutdown-timeout", "0.5",
                                                   "--api-server-count", processes])

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as c:
            started = asyncio.Event()
            stream = asyncio.ensure_future(read_stream(c, chat("HUNG_GPU_STEP", True), started))
            await asyncio.wait_for(started.wait(), 30)
            server.process.send_signal(signal.SIGTERM)
            return await stream

    events = sse_events(asyncio.run(run()))
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert exited(server) == 0


def _api_process(server) -> int:
    """The pid of a split server's API process (the engine process's one child)."""
    pid = server.process.pid
    (child,) = map(int, open(f"/proc/{pid}/task/{pid}/children").read().split())
    return child


def _gone(pid: int, timeout_s: float = EXIT_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as status:
                if any(line.startswith("State:") and "Z" in line.split()[1] for line in status):
                    return True                     # exited; its new parent has not reaped it yet
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_split_servers_engine_exits_1_when_its_api_process_dies(request):
    server = own_server(request, "api-killed", ["--api-key", API_KEY, "--served-model-name", SCRIPTED_MODEL,
                                                 "--api-server-count", "1"])
    os.kill(_api_process(server), signal.SIGKILL)
    assert exited(server) == 1


def test_a_split_servers_api_process_exits_when_the_engine_process_dies(request):
    server = own_server(request, "engine-killed", ["--api-key", API_KEY, "--served-model-name", SCRIPTED_MODEL,
                                                    "--api-server-count", "1"])
    api = _api_process(server)
    server.process.kill()
    server.process.wait()
    assert _gone(api)
