"""Both bench commands end to end on flint-tiny: latency on the CPU, serve against a real server."""

import json

import pytest

from api_server import shared_server
from flint_sched.cli import main


def test_bench_latency_smoke(tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", "flint-tiny", "--device", "cpu", "--batch-sizes", "1,3",
                 "--contexts", "16,600", "--prefill-lens", "40", "--num-steps", "2",
                 "--max-num-batched-tokens", "32", "--mixed-chunks", "24", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(d["batch"], d["context"]) for d in result["decode"]] == [(1, 16), (3, 16), (1, 600), (3, 600)]
    assert all(d["step_ms"] > 0 and d["bytes_per_step"] > 0 for d in result["decode"])
    # each decode case beside a prompt chunk ending at its context (16: the whole 16 positions)
    assert [(m["batch"], m["context"], m["chunk"]) for m in result["mixed"]] == [
        (1, 16, 16), (3, 16, 16), (1, 600, 24), (3, 600, 24)]
    assert all(m["step_ms"] > 0 for m in result["mixed"])
    assert result["prefill_tokens_per_s"]["40"] > 0
    assert "decode B=3" in capsys.readouterr().out


def test_bench_latency_prefill_only(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", "flint-tiny", "--device", "cpu", "--batch-sizes", "",
                 "--contexts", "", "--prefill-lens", "24", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decode"] == [] and result["prefill_tokens_per_s"]["24"] > 0


def test_bench_latency_says_when_no_kv_cache_fits():
    with pytest.raises(SystemExit, match="no room for a KV cache: 0.0 GiB"):
        main(["bench", "latency", "--model", "flint-tiny", "--device", "cpu", "--batch-sizes", "1",
              "--contexts", "16", "--kv-budget-gib", "0"])


def test_bench_serve_smoke_against_flint_tiny(request, tmp_path):
    server = shared_server(request, "real")
    assert main(["bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
                 "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "6",
                 "--max-concurrency", "3", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "serve.json", "--no-plot", "--disable-tqdm"]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0


def test_bench_host_and_disconnect_storm_smoke(request):
    """The host-side benchmark around its fake executor, and the disconnect storm against a server:
    every step of every stream accounted for, and the storm leaves the server idle with no 5xx."""
    from flint_sched.benchmarks import bench_host, disconnect_storm
    from flint_sched.checkpoint.make import dummy_checkpoint
    from flint_sched.config import preset
    from flint_sched.llm import run_async

    tokenizer = dummy_checkpoint(preset("flint-tiny"), "bf16", 0, "cpu").tokenizer
    r = run_async(bench_host.run_case(tokenizer, 4096, 8, 6, 1.0))
    assert r["steps"] >= 6 and r["tokens_per_s"] > 0 and 0 <= r["gpu_idle_share"] < 1
    assert 0 <= r["steady_idle_share"] < 1   # steps decoding all 8 streams exist
    server = shared_server(request, "real")
    args = disconnect_storm.argparse.Namespace(base_url=server.base_url, concurrency=6, requests=12, drop_fraction=0.5,
                                               max_tokens=8, max_prompt_words=10, timeout=60.0, idle_timeout=10.0,
                                               seed=0, output_json=None)
    report = run_async(disconnect_storm.storm(args))
    assert report["statuses"] == {"200": 12} and sum(report["outcomes"].values()) == 12
    assert report["outcomes"].get("dropped", 0) > 0 and not any(report["idle_gauges"].values())


def test_bench_server_host_smoke(tmp_path, monkeypatch):
    """The server-level host benchmark: a real server on the fake executor, driven by bench serve;
    every request completes and the fake GPU's steps are counted."""
    from flint_sched.benchmarks import bench_server_host
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    r = bench_server_host.run_case(streams=4, gpu_ms=1.0, tokens=8, prompt_len=16, num_prompts=8)
    assert r["output_tok_s"] > 0 and r["steps"] >= 8 and 0 <= r["gpu_idle_share"] < 1
    assert 0 < r["median_itl_ms"] < 1000


def test_bench_structured_smoke():
    from flint_sched.benchmarks.bench_structured import run
    from flint_sched.tokenizer import build_tokenizer
    result = run(build_tokenizer(512, seed=0), batch=3, device="cpu", num_steps=4, warmup_steps=2)
    assert result["grammar_ms"] > 0 and result["plain_ms"] > 0 and result["fill_ms"] > 0
    assert result["warmup_ms"] >= result["warmup_max_ms"] > 0


def test_bench_agent_sim_smoke():
    import argparse

    from flint_sched.benchmarks.bench_agent_sim import run_case
    from flint_sched.llm import run_async
    args = argparse.Namespace(sessions=2, turns=3, system_tokens=600, first_tokens=20, grow=40, output_tokens=4,
                              step_ms=0.5, us_per_prompt_token=0.1, max_num_batched_tokens=2048, max_num_seqs=4,
                              num_ring_snapshots=2, stagger_ms=0.0, prompt_host_ms=1.0, prompt_graph_rows=0,
                              prompt_floor_ms=1.0, think_ms=1.0, launch_margin_ms=0.1)
    cached, cold = run_async(run_case(args, True)), run_async(run_case(args, False))
    assert cached["steps"] > 0 and cached["ttft_turn0_ms"] > 0 and cached["ttft_later_ms"] > 0
    assert cached["hit_rate"] > 0.5 and cold["hit_rate"] == 0


async def test_serve_cost_model_streams_a_chat_turn_with_tools():
    import httpx

    from flint_sched.api.server import build_app
    from flint_sched.benchmarks.serve.datasets import AGENT_TOOLS
    from flint_sched.benchmarks.serve_cost_model import SERVER_CONFIG, engine_state

    app = build_app(engine_state(0.5, 0.1, max_num_seqs=2, async_scheduling=True), SERVER_CONFIG)
    body = {"messages": [{"role": "user", "content": "Fix the tests."}], "tools": AGENT_TOOLS, "max_tokens": 4,
            "stream": True, "ignore_eos": True}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")


def test_agent_sim_eager_prompt_steps_take_the_host_floor():
    from flint_sched.benchmarks.bench_agent_sim import CostExecutor
    from flint_sched.core.plan import ScheduledRequest, StepPlan
    from flint_sched.sampling_params import SamplingParams

    def cost(executor, tokens):
        entry = ScheduledRequest("p", [7] * tokens, 0, list(range(4)), 0, True, SamplingParams(temperature=0), [],
                                 [], False)
        end, _ = executor.launch(StepPlan([entry], tokens, "grouped", [], []))
        return end - executor.starts[-1]

    executor = CostExecutor(1000, step_ms=1.0, us_per_prompt_token=10.0, prompt_host_ms=40.0, prompt_graph_rows=32)
    assert cost(executor, 1) == pytest.approx(1e-3)             # a decode row: no prompt tokens
    assert cost(executor, 32) == pytest.approx(1.32e-3)         # a prompt step from a graph
    assert cost(executor, 33) == pytest.approx(40e-3)           # eager: the host's launches bound it
    assert cost(executor, 5000) == pytest.approx(51e-3)         # ... until the GPU needs longer
    floored = CostExecutor(1000, step_ms=1.0, us_per_prompt_token=10.0, prompt_floor_ms=20.0)
    assert cost(floored, 1) == pytest.approx(1e-3)              # decodes: no floor
    assert cost(floored, 100) == pytest.approx(20e-3)           # a short prompt still reads every expert
    assert cost(floored, 5000) == pytest.approx(51e-3)


def test_decode_configs_refuses_unknown_configs_and_a_machine_without_a_gpu(monkeypatch, capsys):
    """benchmarks/decode_configs.py (GPU only) says what is wrong instead of a traceback."""
    import torch

    from flint_sched.benchmarks import decode_configs

    monkeypatch.setattr("sys.argv", ["decode_configs", "--configs", "g1t2,fastest"])
    with pytest.raises(SystemExit, match="unknown configs"):
        decode_configs.main()
    if not torch.cuda.is_available():
        monkeypatch.setattr("sys.argv", ["decode_configs", "--configs", "g1t2", "--batch-sizes", "16"])
        with pytest.raises(SystemExit, match="decode_configs: --device cuda"):
            decode_configs.main()


def test_ab_decode_parses_variants_and_says_what_is_wrong(monkeypatch):
    """benchmarks/ab_decode.py: NAME:module.ATTR=value variants, a clear message for a bad one."""
    import torch

    from flint_sched.benchmarks import ab_decode, latency

    name, sets = ab_decode.parse_variant("fast:flint_sched.kernels.attention.CTAS_PER_SM=6,"
                                         "flint_sched.kernels.expert_decode.CONFIG='g1t4'")
    assert name == "fast" and [(m.__name__, a, v) for m, a, v in sets] == [
        ("flint_sched.kernels.attention", "CTAS_PER_SM", 6), ("flint_sched.kernels.expert_decode", "CONFIG", "g1t4")]
    assert ab_decode.parse_variant("base:") == ("base", [])
    _, [(_, _, dtypes)] = ab_decode.parse_variant(
        "cp:flint_sched.kernels.attention.CP_ASYNC_DTYPES=(torch.bfloat16, torch.float8_e4m3fn)")
    assert dtypes == (torch.bfloat16, torch.float8_e4m3fn)
    for bad, message in [(":x.Y=1", "NAME:"), ("v:CTAS=6", "not module.ATTR=value"),
                         ("v:flint_sched.kernels.attention.NOPE=1", "has no NOPE"),
                         ("v:flint_sched.kernels.attention.CTAS_PER_SM=os.sep", "value 'os.sep'"),
                         ("v:flint_sched.kernels.attention.CTAS_PER_SM=torch.nope", "value 'torch.nope'")]:
        with pytest.raises(ValueError, match=message):
            ab_decode.parse_variant(bad)
    monkeypatch.setattr("sys.argv", ["ab_decode", "--variant", "v:flint_sched.kernels.attention.NOPE=1"])
    with pytest.raises(SystemExit, match="ab_decode: variant v"):
        ab_decode.main()
    if not torch.cuda.is_available():
        monkeypatch.setattr("sys.argv", ["ab_decode", "--variant", "base:", "--batch-sizes", "16"])
        with pytest.raises(SystemExit, match="ab_decode: --device cuda"):
            ab_decode.main()
    assert latency.GREEDY.temperature == 0.0


def test_ab_decode_times_decode_and_prompt_steps_under_each_variant(monkeypatch, capsys):
    """ab_decode on flint-tiny's torch path: a row per variant, case and round, prompts in tok/s,
    and the constants a variant set put back afterwards."""
    from flint_sched.benchmarks import ab_decode
    from flint_sched.kernels import grouped_moe

    before = grouped_moe.HYBRID_SPLIT_ROWS
    monkeypatch.setattr("sys.argv", ["ab_decode", "--model", "flint-tiny", "--executor", "torch", "--device", "cpu",
                                     "--weight-format", "bf16", "--batch-sizes", "2", "--contexts", "32",
                                     "--prefill-lens", "48", "--num-steps", "1", "--rounds", "2", "--variant", "base:",
                                     "--variant", "v:flint_sched.kernels.grouped_moe.HYBRID_SPLIT_ROWS=8"])
    assert ab_decode.main() == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| base", "| v "))]
    assert [r.split("|")[1:4] for r in rows] == [
        [" base ", " 2 ", " 32 "], [" base ", " a prompt (tok/s, not ms) ", " 48 "],
        [" v ", " 2 ", " 32 "], [" v ", " a prompt (tok/s, not ms) ", " 48 "]]
    assert all(len(r.split("|")[4].split(" / ")) == 2 and float(r.split("|")[4].split(" / ")[1]) > 0 for r in rows)
    assert grouped_moe.HYBRID_SPLIT_ROWS == before


def test_with_constants_sets_them_before_the_cli_runs(monkeypatch, capsys):
    """benchmarks/with_constants.py (serve_runs.sh's SERVE_SET): the constants are set, then the CLI
    gets the remaining arguments; a bad assignment is refused before anything runs."""
    from flint_sched.benchmarks import with_constants
    from flint_sched.executor import graph_sampler

    monkeypatch.setattr(graph_sampler, "GUMBEL_MAX", True)
    with pytest.raises(SystemExit) as done:
        with_constants.main(["flint_sched.executor.graph_sampler.GUMBEL_MAX=False", "--help"])
    assert done.value.code == 0 and graph_sampler.GUMBEL_MAX is False
    assert "usage: flint-sched" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="with_constants: variant set: .*graph_sampler has no NOPE"):
        with_constants.main(["flint_sched.executor.graph_sampler.NOPE=1", "serve"])


def test_routing_stats_counts_items_per_chunk():
    """benchmarks/routing_stats.py's summary of one layer's rows per expert (the shared expert last)."""
    from flint_sched.benchmarks import routing_stats

    line = routing_stats.summary([0, 3, 9, 17, 0, 1, 16], (8, 16))
    assert "touched   4" in line and "max   17" in line and ">8 rows   2" in line and ">16   1" in line
    # items: ceil(c / 8) over every count (shared included): 0+1+2+3+0+1+2 = 9; at 16: 0+1+1+2+0+1+1 = 6
    assert "items@8    9" in line and "items@16    6" in line


def test_decode_cases_keep_the_cases_whose_kv_fits():
    """latency.decode_cases: contexts outer, blocks per request of context + 1 tokens, a case skipped
    when its requests (and the extra ones) need more blocks than the pool holds."""
    import argparse

    from flint_sched.benchmarks import latency

    args = argparse.Namespace(contexts="15,16", batch_sizes="2,4", block_size=16)
    assert latency.decode_cases(args, 8) == ([(2, 15, 1), (4, 15, 1), (2, 16, 2), (4, 16, 2)], [])
    assert latency.decode_cases(args, 7) == ([(2, 15, 1), (4, 15, 1), (2, 16, 2)], [(4, 16)])
    assert latency.decode_cases(args, 7, extra_seqs=1) == ([(2, 15, 1), (4, 15, 1), (2, 16, 2)], [(4, 16)])
    assert latency.decode_cases(args, 5, extra_seqs=1) == ([(2, 15, 1), (4, 15, 1)], [(2, 16), (4, 16)])


def test_decode_moe_trace_needs_a_gpu(monkeypatch):
    """benchmarks/decode_moe_trace.py (the ED_TRACE build; tests/gpu covers the trace) says what it
    needs on a machine without CUDA, and offers only one-launch configs."""
    import torch

    from flint_sched.benchmarks import decode_moe_trace
    from flint_sched.kernels import grouped_moe

    monkeypatch.setattr("sys.argv", ["decode_moe_trace", "--config", "g1t4d8"])
    with pytest.raises(SystemExit):
        decode_moe_trace.main()
    assert "g1t4d8" not in grouped_moe.FUSED_DECODE_CONFIGS
    if not torch.cuda.is_available():
        monkeypatch.setattr("sys.argv", ["decode_moe_trace", "--tokens", "16"])
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            decode_moe_trace.main()


def test_bench_decode_step_parses_variants():
    """benchmarks/bench_decode_step.py: WARPS[-fold][-fuse][-early][-sN], a clear message otherwise."""
    from flint_sched.benchmarks.bench_decode_step import parse_variant

    assert parse_variant("8") == (8, False, False, False, None)
    assert parse_variant("4-fold-fuse-early-s66") == (4, True, True, True, 66)
    assert parse_variant("8-early") == (8, False, False, True, None)
    for bad in ("6", "8-s0", "8-x", "8-s1-s2", "8-sx"):
        with pytest.raises(SystemExit, match="not WARPS"):
            parse_variant(bad)
