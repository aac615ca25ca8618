"""The server's host side alone, HTTP included: `flint-sched serve` on flint-tiny with bench_host.py's
fake executor (async scheduling, steps of `--gpu-ms` on a fake GPU timeline), driven by `flint-sched
bench serve` with random token ids at each concurrency. Per case: output tokens/s, median time
between tokens, and the share of the run the fake GPU sat idle between steps (the host late).

    python3 -m flint_sched.benchmarks.bench_server_host --streams 64,256 --gpu-ms 0,12 --server-cpu 0 \
        [--stream-interval 1,4] [--api-server-count 0,1]
    python3 -m flint_sched.benchmarks.bench_server_host --streams 256 --gpu-ms 12 --api-server-count 0,1

With --gpu-ms 0 the server is host-bound and tokens/s is the host's rate; with a GPU step time the
idle share says whether the host keeps up. The load generator runs on the same machine:
--server-cpu pins the server to one CPU and the generator to the others, so that a host-bound
rate is the server's own (on the 2-core machine the spread of runs fell from ~10 % to ~4 %).
--api-server-count 1 runs the HTTP server in a process of its own (api/api_process.py); the server
CPU a token is then the engine process's alone, and --server-cpu pins both processes to that CPU.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def serve(gpu_ms: float, port: int, streams: int, stats: str, cpu: int | None, stream_interval: int = 1,
          api_server_count: int = 0) -> int:
    """The server process: flint-tiny's engine around the fake executor; its step counts go to `stats`
    at exit (after a SIGINT has drained it). `cpu`: the one CPU it runs on."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from flint_sched.api.server import ServerConfig, load_engine_state
    from flint_sched.api.server import serve as run_server
    from flint_sched.benchmarks.bench_host import FakeExecutor
    from flint_sched.engine.config import EngineConfig

    state = load_engine_state(EngineConfig(model=None, device="cpu", max_num_seqs=streams,
                                           max_num_batched_tokens=max(8192, streams), stream_interval=stream_interval))
    executor = FakeExecutor(state.parts.checkpoint.config.vocab_size, gpu_ms)
    state.parts = dataclasses.replace(state.parts, executor=executor, async_scheduling=True)

    cpu_start = time.process_time()              # the serving's CPU time (all threads), not the loading's

    def report() -> None:
        span = executor.ends[-1] - executor.starts[0] if executor.ends else 0.0
        Path(stats).write_text(json.dumps({"steps": executor.steps, "busy_s": executor.busy_s, "span_s": span,
                                           "cpu_s": time.process_time() - cpu_start}))

    atexit.register(report)
    config = ServerConfig(host="127.0.0.1", port=port, served_model_names=("flint-tiny",), log_level="warning")
    if api_server_count:
        from flint_sched.api.api_process import serve_with_api_process

        return serve_with_api_process(state, config)
    return run_server(state, config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, server: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"the server exited during start-up (code {server.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not become healthy in time")


def run_case(streams: int, gpu_ms: float, tokens: int, prompt_len: int, num_prompts: int,
             server_cpu: int | None = None, stream_interval: int = 1, api_server_count: int = 0) -> dict:
    """One server and one `bench serve` run against it; server_cpu: pin the server to that CPU and the
    load generator to the others (a host-bound server's rate is then its own)."""
    port = free_port()
    pin = [] if server_cpu is None else ["--server-cpu", str(server_cpu)]
    others = None if server_cpu is None else (set(os.sched_getaffinity(0)) - {server_cpu} or None)
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        result = Path(tmp) / "bench.json"
        log = (Path(tmp) / "server.log").open("w")
        server = subprocess.Popen([sys.executable, "-m", "flint_sched.benchmarks.bench_server_host", "--serve",
                                   "--gpu-ms", str(gpu_ms), "--port", str(port), "--streams", str(streams),
                                   "--stats", str(stats), "--stream-interval", str(stream_interval),
                                   "--api-server-count", str(api_server_count), *pin],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, server, Path(log.name))
            load = [sys.executable, "-m", "flint_sched.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", "flint-tiny", "--endpoint", "/v1/completions", "--dataset-name", "random",
                    "--random-token-ids", "--ignore-eos", "--random-input-len", str(prompt_len),
                    "--random-output-len", str(tokens), "--num-prompts", str(num_prompts),
                    "--max-concurrency", str(streams), "--seed", "0", "--disable-tqdm", "--save-result", "--no-plot",
                    "--result-filename", str(result)]
            bench_run = subprocess.run(load, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=None if others is None else lambda: os.sched_setaffinity(0, others))
            if bench_run.returncode:
                raise SystemExit(f"bench serve failed (code {bench_run.returncode}):\n{bench_run.stderr[-2000:]}")
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
        bench = json.loads(result.read_text())
        steps = json.loads(stats.read_text()) if stats.exists() else {}
    idle = 1 - steps["busy_s"] / steps["span_s"] if gpu_ms and steps.get("span_s") else None
    cpu_us = 1e6 * steps["cpu_s"] / bench["total_output_tokens"] if "cpu_s" in steps else None
    return {"streams": streams, "gpu_ms": gpu_ms, "stream_interval": stream_interval, "api": api_server_count,
            "output_tok_s": bench["output_throughput"],
            "median_itl_ms": bench["median_itl_ms"], "steps": steps.get("steps"), "gpu_idle_share": idle,
            "server_cpu_us_per_token": cpu_us}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="64,256")
    p.add_argument("--gpu-ms", default="0,12", help="the fake GPU's step time(s) in ms")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=2)
    p.add_argument("--server-cpu", type=int, default=None,
                   help="pin the server to this CPU and the load generator to the others")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)    # the server process
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stream-interval", default="1",
                   help="the server's --stream-interval(s) to compare, e.g. 1,4 (%(default)s)")
    p.add_argument("--api-server-count", default="0",
                   help="the server's --api-server-count(s) to compare, e.g. 0,1 (%(default)s)")
    p.add_argument("--stats", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(float(args.gpu_ms), args.port, int(args.streams), args.stats, args.server_cpu,
                     int(args.stream_interval), int(args.api_server_count))
    os.environ.setdefault("FLINT_SCHED_CACHE", str(Path(tempfile.gettempdir()) / "flint-sched-bench-cache"))
    print("| streams | GPU ms/step | stream interval | API processes | output tok/s | median ITL ms | steps | "
          "GPU idle | server CPU µs a token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for streams in (int(s) for s in args.streams.split(",")):
        for gpu_ms in (float(g) for g in args.gpu_ms.split(",")):
            for interval in (int(i) for i in args.stream_interval.split(",")):
                for api in (int(a) for a in args.api_server_count.split(",")):
                    r = run_case(streams, gpu_ms, args.tokens, args.prompt_len, streams * args.prompts_per_stream,
                                 args.server_cpu, interval, api)
                    idle = "–" if r["gpu_idle_share"] is None else f"{100 * r['gpu_idle_share']:.1f} %"
                    print(f"| {streams} | {gpu_ms:g} | {interval} | {api} | {r['output_tok_s']:.0f} | "
                          f"{r['median_itl_ms']:.2f} | {r['steps']} | {idle} | {r['server_cpu_us_per_token']:.1f} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
