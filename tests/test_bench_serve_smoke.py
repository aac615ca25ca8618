"""`bench serve` end to end (`main.run`) against the fake OpenAI-compatible server on loopback: the table, the JSON
result and the PNG plots, a concurrency sweep, failures, the --max-duration cap and the loopback guard."""

import argparse
import importlib.util
import json
import time

import pytest

from flint_sched.benchmarks.serve import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # the `bench` extra, not the `test` one


@pytest.fixture
def fake(fake):
    """conftest's fake server, answering a token every millisecond."""
    fake.token_delay_s = 0.001
    return fake


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


def test_random_chat_run_writes_table_json_and_plots(fake, tmp_path, capsys):
    fake.token_delay_s = 0.03              # a run of > 0.1 s: the client's CPU share is reported
    args = parse("--base-url", fake.url, "--num-prompts", "8", "--num-warmups", "2", "--random-input-len", "30",
                 "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "200",
                 "--burstiness", "0.5", "--ignore-eos", "--goodput", "ttft:2000", "e2el:5000", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert main.run(args) == 0
    table, log = capsys.readouterr()
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms)" in table and "P99 ITL (ms)" in table
    assert "Request goodput (req/s)" in table and "Client CPU (% of one core)" in table
    result = json.loads((tmp_path / "run.json").read_text())
    assert 0 < result["client_cpu_percent"] < 400
    assert result["completed"] == 8 and result["failed"] == 0 and result["model"] == "flint-fake"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    bodies = [r["body"] for r in fake.requests if r["path"] == "/v1/chat/completions"]
    assert len(bodies) == 10  # warm-ups are sent, not measured
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert result["output_lens"] == [b["max_tokens"] for b in bodies[2:]]  # usage counted the fake's tokens
    assert result["total_output_tokens"] == sum(b["max_tokens"] for b in bodies[2:])
    assert len(result["itls"]) == sum(n - 1 for n in result["output_lens"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "output_throughput"):
        assert result[key] > 0
    if HAS_MATPLOTLIB:
        assert (tmp_path / "run-latency-cdf.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "plots skipped: matplotlib is not installed" in log


def test_completions_concurrency_sweep(fake, tmp_path, capsys):
    args = parse("--base-url", fake.url + "/", "--endpoint", "/v1/completions", "--model", "m", "--num-prompts", "6",
                 "--random-token-ids", "--random-input-len", "8", "--random-output-len", "4",
                 "--max-concurrency", "1,3", "--save-result", "--result-dir", str(tmp_path))
    assert main.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "max_concurrency" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    results = [json.loads((tmp_path / f).read_text()) for f in files if f.endswith(".json")]
    assert [r["max_concurrency"] for r in results] == [1, 3]
    assert all(r["completed"] == 6 and r["endpoint_type"] == "completions" for r in results)
    assert sum(f.endswith("-sweep.png") for f in files) == HAS_MATPLOTLIB
    assert sum(f.endswith("-latency-cdf.png") for f in files) == HAS_MATPLOTLIB
    assert all(isinstance(r["body"]["prompt"], list) for r in fake.requests)


def test_agent_run_counts_failures_with_reasons(fake, capsys):
    error = {"error": {"message": "tool_choice auto needs --enable-auto-tool-choice", "type": "BadRequestError"}}
    fake.failures = [(400, error)] * 2
    args = parse("--base-url", fake.url, "--dataset-name", "agent", "--num-prompts", "6", "--agent-num-turns", "3",
                 "--agent-system-prompt-len", "20", "--agent-tool-result-len", "10", "--agent-output-len", "4",
                 "--max-concurrency", "1")
    assert main.run(args) == 0
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "2 x HTTP 400 BadRequestError: tool_choice auto needs" in out
    bodies = [r["body"] for r in fake.requests if r["body"]]
    assert all(b["tools"] and b["messages"][0]["role"] == "system" for b in bodies)
    assert max(len(b["messages"]) for b in bodies) > 2


def test_a_refused_connection_is_a_connection_error(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]             # closed again: nothing listens there
    args = parse("--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2")
    assert main.run(args) == 1
    out = capsys.readouterr().out
    assert "2 x FlintConnectionError" in out and "Client CPU" not in out


def test_max_duration_cancels_streams(fake, capsys):
    fake.endless_stream = True
    args = parse("--base-url", fake.url, "--model", "m", "--num-prompts", "3", "--max-duration", "0.3")
    assert main.run(args) == 1  # nothing completed
    assert "3 x cancelled: --max-duration reached" in capsys.readouterr().out
    # Every stream the server began ends long before its 1,000 chunks (10 s): the client closed it.
    # (On a loaded machine a request may still be unanswered at 0.3 s; it then never streams.)
    deadline = time.monotonic() + 5
    while fake.open_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.open_streams == 0, f"{fake.open_streams} cancelled streams still written by the server"


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "http://example.com:8000"], "--allow-remote"),
    (["--base-url", "http://10.0.0.1:8000"], "--allow-remote"),
    (["--endpoint", "/v1/embeddings"], "--endpoint"),
    (["--dataset-name", "agent", "--endpoint", "/v1/completions"], "chat/completions"),
    (["--dataset-name", "file"], "--dataset-path"),
    (["--request-rate", "1,2", "--max-concurrency", "1,2"], "not both"),
    (["--goodput", "ttft=5"], "--goodput"),
    (["--random-range-ratio", "1.5"], "range-ratio"),
])
def test_invalid_flags_are_refused_before_any_request(argv, message, capsys):
    assert main.run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_loopback_detection():
    assert main.is_loopback_url("http://127.0.0.1:8000") and main.is_loopback_url("http://[::1]:8000/v1")
    assert main.is_loopback_url("http://localhost:8000") and main.is_loopback_url("http://127.3.2.1")
    assert not main.is_loopback_url("https://api.openai.com") and not main.is_loopback_url("http://192.168.1.2")


def test_the_client_streams_over_aiohttp():
    """httpx-aiohttp is a dependency: `bench serve` reads its streams through aiohttp's parser."""
    from httpx_aiohttp import AiohttpTransport
    assert isinstance(main.aiohttp_transport(), AiohttpTransport)
