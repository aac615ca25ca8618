"""`flint-sched serve`'s command line: vLLM's flags, errors with serve's usage, checks before loading."""

import socket
from pathlib import Path

import pytest

from flint_sched import cli_vllm
from flint_sched.cli import build_parser, main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def tiny_app(tiny_config, server_config, **engine_fields):
    """The server's app in process, over dummy bf16 weights of flint-tiny's shapes on the CPU."""
    from flint_sched.api.server import EngineState, build_app
    from flint_sched.checkpoint.make import dummy_checkpoint
    from flint_sched.engine.builder import build_parts
    from flint_sched.engine.config import EngineConfig
    ckpt = dummy_checkpoint(tiny_config, "bf16", seed=3, device="cpu")
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=64, max_model_len=128,
                                     **engine_fields), progress=False, checkpoint=ckpt)
    return build_app(EngineState(parts, "dummy"), server_config)


def test_common_vllm_launch_flags_are_accepted_with_notices():
    args = serve_args("-tp", "1", "--disable-log-requests", "--dtype", "auto", "--trust-remote-code",
                      "--enable-prompt-tokens-details", "--max-logprobs", "5",
                      "--block-size", "32", "--disable-frontend-multiprocessing")
    notices = cli_vllm.check(args)
    assert any(n.startswith("--tensor-parallel-size 1: ignored") for n in notices)
    assert any(n.startswith("--enable-prompt-tokens-details: ignored") for n in notices)
    assert any(n.startswith("--trust-remote-code") for n in notices)
    assert not any(flag in n for n in notices for flag in ("max-logprobs", "block-size"))
    assert args.vllm_block_size == "32"                 # they mean something here
    assert len(notices) == 4


@pytest.mark.parametrize("argv, reason", [
    (["-tp", "2"], "one GPU"), (["--pipeline-parallel-size", "4"], "one GPU"),
    (["--kv-cache-dtype", "fp8_e5m2"], "invalid choice"), (["--block-size", "0"], "positive number of tokens"),
    (["--speculative-config", "{}"], "speculative decoding"), (["--enable-lora"], "LoRA"),
    (["--cpu-offload-gb", "8"], "offloaded"), (["--max-logprobs", "50"], "[0, 20]"),
    (["--enable-sleep-mode"], "sleep mode"), (["--lora-modules", "a=b"], "LoRA"),
    (["--allowed-origins", "*"], "JSON list of strings"),
])
def test_what_is_not_done_here_is_refused_with_serves_usage(argv, reason, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: flint-sched serve" in err and reason in err, err
    assert not any(tmp_path.iterdir())                  # refused before anything was made or loaded


def test_an_unknown_flag_shows_serves_usage(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert "usage: flint-sched serve" in err and "unrecognized arguments: --no-such-flag" in err


def test_a_taken_port_is_reported_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--device", "cpu", "--port", str(taken.getsockname()[1])]) == 2
    assert "already in use" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())                  # flint-tiny was not generated


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--device", "cpu", "--executor", "cuda"], "--executor cuda needs a CUDA GPU"),
])
def test_cuda_without_a_gpu_fails_at_once(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    for command in (["serve", "--port", "0"], ["generate", "--prompt", "x"]):
        assert main([*command, *argv]) == 2
        assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_startup_summary_says_what_was_loaded():
    from flint_sched.engine.builder import build_parts
    from flint_sched.engine.config import EngineConfig
    from flint_sched.engine.summary import format_summary
    parts = build_parts(EngineConfig(model="flint-tiny", load_format="dummy", device="cpu", max_num_seqs=4,
                                     num_kv_blocks=32), progress=False)
    text = format_summary(parts)
    for expected in ("random weights made on the device", "dummy", "device", "cpu", "executor", "torch",
                     "512 tokens of full-attention KV (32 blocks of 16); 4 concurrent sliding windows",
                     "max model len", "gibberish"):
        assert expected in text, text


def test_the_docs_table_lists_every_vllm_flag():
    text = DOCS.read_text(encoding="utf-8")
    table = {line.split("|")[1].strip().strip("`").split()[0] for line in text.splitlines()
             if line.startswith("| `-")}
    flags = {flag.names[0] for flag in cli_vllm.COMPAT_FLAGS} | set(cli_vllm.NATIVE_FLAGS)
    assert table == flags, (table - flags, flags - table)
    for flag in cli_vllm.COMPAT_FLAGS:
        assert flag.what_happens in text, flag.names[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_bench_latency_with_the_cuda_executor_and_no_gpu_fails_at_once(capsys):
    assert main(["bench", "latency", "--model", "flint", "--executor", "cuda", "--device", "cpu"]) == 2
    assert "--executor cuda needs a CUDA GPU" in capsys.readouterr().err


def test_vllm_server_flags_reach_the_server_config():
    from flint_sched.cli import _vllm_server_fields
    args = serve_args("--allowed-origins", '["https://a.example"]', "--allow-credentials", "--root-path", "/llm",
                      "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--disable-uvicorn-access-log",
                      "--enable-request-id-headers", "--enable-force-include-usage", "--disable-fastapi-docs",
                      "-O3", "--limit-mm-per-prompt", '{"image": 0}')
    notices = cli_vllm.check(args)
    assert {n.split()[0].rstrip(":") for n in notices} == {"--disable-fastapi-docs", "--compilation-config",
                                                           "--limit-mm-per-prompt"}
    fields = _vllm_server_fields(args)
    assert fields["allowed_origins"] == ("https://a.example",) and fields["allowed_methods"] == ("*",)
    assert fields["allow_credentials"] and fields["root_path"] == "/llm" and not fields["access_log"]
    assert (fields["ssl_keyfile"], fields["ssl_certfile"], fields["ssl_ca_certs"]) == ("k.pem", "c.pem", None)
    assert fields["request_id_headers"] and fields["force_include_usage"]
    defaults = _vllm_server_fields(serve_args())
    assert defaults["allowed_origins"] == ("*",) and defaults["access_log"] and not defaults["request_id_headers"]


async def test_cors_request_id_headers_root_path_and_forced_usage(tiny_config):
    import httpx

    from flint_sched.api.server import ServerConfig
    config = ServerConfig(api_key="k", request_id_headers=True, force_include_usage=True, root_path="/llm")
    app = tiny_app(tiny_config, config)
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, root_path="/llm")
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            answer = await client.options("/llm/v1/chat/completions", headers=preflight)
            assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
            assert (await client.post("/llm/v1/chat/completions", json=chat)).status_code == 401   # key asked
            key = {"Authorization": "Bearer k", "X-Request-Id": "trace-1"}
            streamed = await client.post("/llm/v1/chat/completions", json=chat, headers=key)
            assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "trace-1"
            assert '"usage":{"prompt_tokens"' in streamed.text.rsplit("data: ", 2)[1]      # not asked for
            assert len((await client.get("/llm/health")).headers["x-request-id"]) == 32


async def test_generation_config_overrides_are_the_defaults_of_what_a_request_leaves_out(tiny_config):
    import httpx

    from flint_sched.api.server import ServerConfig
    args = serve_args("--override-generation-config", '{"temperature": 0, "max_new_tokens": 3}')
    assert cli_vllm.check(args) == []
    defaults = cli_vllm.generation_defaults(args.vllm_override_generation_config)
    assert defaults == {"temperature": 0, "max_tokens": 3}
    with pytest.raises(ValueError, match="do_sample"):
        cli_vllm.generation_defaults('{"do_sample": true}')
    with pytest.raises(ValueError, match="override-generation-config.*temperature"):
        ServerConfig(sampling_defaults={"temperature": -1})
    app = tiny_app(tiny_config, ServerConfig(sampling_defaults=defaults))
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            async def ask(**fields):
                answer = (await client.post("/v1/chat/completions", json={**chat, **fields})).json()
                return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]

            first, second = await ask(), await ask()
            assert first == second and first[1] == 3                 # greedy, and capped at max_new_tokens
            assert (await ask(max_tokens=5))[1] == 5
            sampled = {(await ask(temperature=1.0, seed=seed))[0] for seed in range(4)}
            assert len(sampled) > 1                                    # a request's own temperature wins


def test_a_checkpoints_generation_config_becomes_the_sampling_defaults(tmp_path, monkeypatch):
    import json
    import shutil

    from flint_sched.api.server import ServerConfig
    from flint_sched.api.startup import server_lines
    from flint_sched.checkpoint.make import default_checkpoint_path
    from flint_sched.engine.builder import build_parts
    from flint_sched.engine.config import EngineConfig
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(default_checkpoint_path("flint-tiny", progress=False), checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "eos_token_id": [0]}))

    def defaults(choice):
        config = EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=2, num_kv_blocks=16,
                              max_model_len=64, generation_config=choice)
        return build_parts(config, progress=False).sampling_defaults

    assert defaults("auto") == {"temperature": 0.3} and defaults("vllm") == {}
    from flint_sched import LLM
    llm = LLM(str(checkpoint), progress=False, device="cpu", max_num_seqs=2, num_kv_blocks=16, max_model_len=64)
    assert llm.get_default_sampling_params().temperature == 0.3      # what generate() uses without params
    line = server_lines(ServerConfig(sampling_defaults={"temperature": 0.3}))["sampling defaults"]
    assert line.startswith("temperature 0.3") and server_lines(ServerConfig())["sampling defaults"] == "vLLM's"


async def test_max_logprobs_caps_what_a_request_may_ask(tiny_config):
    import httpx

    from flint_sched.api.server import ServerConfig
    app = tiny_app(tiny_config, ServerConfig(max_logprobs=2))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            over = await client.post("/v1/chat/completions", json={**chat, "top_logprobs": 3})
            assert over.status_code == 400 and "--max-logprobs" in over.json()["error"]["message"]
            assert (await client.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})).status_code == 200
            over = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 3})
            assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"


def test_one_revision_for_every_hub_name(capsys):
    assert main(["generate", "--prompt", "x", "--revision", "v1", "--tokenizer-revision", "v2"]) == 2
    assert "one revision applies to every hub name" in capsys.readouterr().err


def test_prefix_caching_is_on_unless_turned_off():
    assert serve_args().enable_prefix_caching is True
    assert serve_args("--enable-prefix-caching").enable_prefix_caching is True
    assert serve_args("--no-enable-prefix-caching").enable_prefix_caching is False
    assert serve_args("--num-ring-snapshots", "8").num_ring_snapshots == 8


def test_long_prefill_token_threshold_reaches_the_scheduler_and_refuses_negatives(tmp_path, monkeypatch, capsys):
    assert serve_args().long_prefill_token_threshold == 0
    assert serve_args("--long-prefill-token-threshold", "512").long_prefill_token_threshold == 512
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    assert main(["serve", "--device", "cpu", "--port", "0", "--long-prefill-token-threshold", "-1"]) == 2
    assert "long_prefill_token_threshold must be >= 0" in capsys.readouterr().err


async def test_stream_interval_groups_the_server_sent_events(tiny_config):
    """--stream-interval 4 through the server: a greedy streamed completion sends its first token
    alone, then chunks of 4 tokens; the text (and usage) as with every token sent; a bad value is
    refused before anything loads."""
    import json

    import httpx

    from flint_sched.api.server import ServerConfig
    assert serve_args().stream_interval == 1 and serve_args("--stream-interval", "4").stream_interval == 4
    body = {"prompt": "tell me", "max_tokens": 11, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 1}

    async def stream(interval):
        app = tiny_app(tiny_config, ServerConfig(), stream_interval=interval)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
                r = await client.post("/v1/completions", json=body)
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        chunks = [e["choices"][0] for e in events if e["choices"]]
        usage = [e["usage"] for e in events if e.get("usage")][-1]
        return chunks, usage

    every, usage_1 = await stream(1)
    grouped, usage_4 = await stream(4)
    assert "".join(c["text"] for c in grouped) == "".join(c["text"] for c in every)
    assert usage_4 == usage_1 and usage_4["completion_tokens"] == 11
    per_chunk = [len(c["logprobs"]["tokens"]) for c in grouped if c["logprobs"]]
    assert per_chunk == [1, 4, 4, 2] and len([c for c in every if c["logprobs"]]) == 11
    from flint_sched.engine.config import EngineConfig
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
