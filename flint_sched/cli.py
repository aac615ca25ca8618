"""The `flint-sched` command: argparse lives here and nowhere else."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from flint_sched import cli_vllm
from flint_sched.checkpoint.common import CheckpointError
from flint_sched.config import PRESETS, ConfigError

MODEL_HELP = ("a .gguf file, a Hugging Face checkpoint directory, a Hugging Face Hub repository (owner/repo, "
              "or owner/repo:file.gguf for one file of it), or a preset")
HUB_HELP = " (a path, or a Hugging Face Hub repository)"


def _add_source_args(p: argparse.ArgumentParser) -> None:
    """Where the weights, config and tokenizer come from, and how they run: shared by generate and serve."""
    p.add_argument("--hf-config-path", default=None, help="config.json overriding the checkpoint's own" + HUB_HELP)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its directory) overriding the checkpoint's own" + HUB_HELP)
    p.add_argument("--revision", default=None, help="branch, tag or commit of Hugging Face Hub names (main)")
    p.add_argument("--tokenizer-revision", default=None, help="must equal --revision when given (one revision)")
    p.add_argument("--download-dir", default=None,
                   help="Hugging Face cache directory (default: huggingface_hub's, under $HF_HOME)")
    p.add_argument("--load-format", default="auto", choices=("auto", "gguf", "safetensors", "dummy"))
    p.add_argument("--weight-format", default="nvfp4", choices=("nvfp4", "bf16"),
                   help="weights made by --load-format dummy")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (%(default)s)")
    p.add_argument("--executor", default="auto", choices=("auto", "torch", "cuda"),
                   help="auto: our CUDA kernels on a GPU when the model's shapes allow, else torch")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "half", "float32", "float"),
                   help="compute dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                   help="auto: the compute dtype; fp8 (= fp8_e4m3): e4m3 keys and values, scale 1, as vLLM's "
                        "fp8 without calibrated scales: half the KV memory and the attention reads of bf16, "
                        "for a small loss of accuracy")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA executor: no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous step's tokens reach the host, so "
                        "the GPU never waits for the host between steps (default: on with the CUDA executor)")
    p.add_argument("--launch-margin-ms", type=float, default=0.0,
                   help="with async scheduling, plan each step this long before the running decode step is "
                        "expected to end (or when a request arrives) instead of as soon as it starts, so a new "
                        "request joins the next step; 0 (default): off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)


def _engine_args(args: argparse.Namespace) -> dict:
    """EngineConfig's fields from the shared flags."""
    if args.tokenizer_revision is not None and args.tokenizer_revision != args.revision:
        raise ValueError("--tokenizer-revision differs from --revision: one revision applies to every hub name")
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return dict(load_format=args.load_format, weight_format=args.weight_format, hf_config_path=args.hf_config_path,
                tokenizer=args.tokenizer, revision=args.revision, download_dir=args.download_dir,
                device=args.device, executor=args.executor, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling, launch_margin_ms=args.launch_margin_ms, seed=args.seed,
                max_model_len=args.max_model_len)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flint-tiny", help=MODEL_HELP + " (%(default)s)")
    _add_source_args(p)


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from flint_sched.checkpoint.make import make_checkpoint
    from flint_sched.config import preset
    start = time.perf_counter()
    out = make_checkpoint(preset(args.preset), args.format, args.seed, args.out, args.device,
                          progress=not args.no_progress)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from flint_sched.llm import LLM
    from flint_sched.sampling_params import SamplingParams
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, progress=not args.json, **_engine_args(args))
    for prompt, result in zip(args.prompt, llm.generate(args.prompt, params), strict=True):
        choice = result.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "prompt_token_ids": result.prompt_token_ids,
                              "output_token_ids": choice.token_ids, "text": choice.text,
                              "finish_reason": choice.finish_reason}, ensure_ascii=False))
        else:
            print(prompt + choice.text)
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from flint_sched.api.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP + " (default: flint-tiny)")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) requests use for the model (default: MODEL)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests running at once (default: 256 on a GPU, 64 on the CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, prompt chunks and decodes together (default: 8192 on a GPU, 2048 on the CPU)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="at most N tokens of one prompt per step, so long prompts share steps with running "
                        "decodes in smaller chunks (0: up to the step's budget)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="send a stream's tokens every N tokens (the first at once, the last when it ends): "
                        "fewer server-sent events and less server CPU per token, for coarser streaming "
                        "(1, the default: every token)")
    p.add_argument("--api-server-count", type=int, default=None, choices=(0, 1), metavar="N",
                   help="1: the HTTP server in a process of its own beside the engine's, so that streaming "
                        "to many clients never holds up the GPU's steps; 0: one process (default: 1 on a "
                        "GPU, 0 on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (on by default, as in vLLM v1)")
    p.add_argument("--num-ring-snapshots", type=int, default=None, metavar="N",
                   help="prefix caching: sliding-window ring snapshots kept, each the size of one request's "
                        "rings (default: --max-num-seqs)")
    _add_source_args(p)
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSER_NAMES)
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES)
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='leave tools out of the prompt when tool_choice is "none"')
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, or the template itself")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   help='JSON object of chat template kwargs, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own `chat_template` (a Jinja template, sandboxed, run on the server); "
                        "without it such a request gets 400")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 32 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, let requests in flight run this long, then abort the rest "
                        "(default: 20; 0: abort at once)")
    p.add_argument("--engine-iteration-timeout-s", type=float, default=None, metavar="SECONDS",
                   help="the step watchdog: a step running longer ends the engine and the process exits with "
                        "status 1 (default: 300, which covers first-step kernel compilation and graph capture; "
                        "0: no watchdog)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    p.add_argument("--scripted-executor", default=None, help=argparse.SUPPRESS)   # tests: replay a script
    cli_vllm.add_arguments(p)


def _vllm_server_fields(args: argparse.Namespace) -> dict:
    """ServerConfig's fields from vLLM's server flags (cli_vllm: CORS, the proxy prefix, TLS, logs)."""
    return {
        **{name: cli_vllm.json_strings(f"--{name.replace('_', '-')}", getattr(args, f"vllm_{name}"))
           for name in ("allowed_origins", "allowed_methods", "allowed_headers")},
        "allow_credentials": bool(args.vllm_allow_credentials), "root_path": args.vllm_root_path or "",
        "ssl_keyfile": args.vllm_ssl_keyfile, "ssl_certfile": args.vllm_ssl_certfile,
        "ssl_ca_certs": args.vllm_ssl_ca_certs, "access_log": not args.vllm_disable_uvicorn_access_log,
        "request_id_headers": bool(args.vllm_enable_request_id_headers),
        "force_include_usage": bool(args.vllm_enable_force_include_usage),
        "sampling_defaults": cli_vllm.generation_defaults(args.vllm_override_generation_config),
    }


def cmd_serve(args: argparse.Namespace) -> int:
    from flint_sched.api.server import (
        DEFAULT_ENGINE_ITERATION_TIMEOUT_S,
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        ServerConfig,
        load_engine_state,
        resolve_chat_template,
        serve,
    )
    from flint_sched.api.startup import check_port_free, print_summary
    from flint_sched.engine.config import EngineConfig
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    try:
        notices = cli_vllm.check(args)
    except ValueError as e:
        args.parser.error(str(e))
    for notice in notices:
        print(f"flint-sched: note: {notice}", file=sys.stderr)
    model = args.model_tag or args.model
    server_config = ServerConfig(
        host=args.host, port=args.port,
        served_model_names=tuple(args.served_model_name or [model or "flint-tiny"]),
        api_key=args.api_key, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        chat_template=resolve_chat_template(args.chat_template),
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        shutdown_timeout_s=DEFAULT_SHUTDOWN_TIMEOUT_S if args.shutdown_timeout is None else args.shutdown_timeout,
        log_level=args.uvicorn_log_level,
        max_logprobs=20 if args.vllm_max_logprobs is None else int(args.vllm_max_logprobs),
        **_vllm_server_fields(args))
    engine_config = EngineConfig(
        model=model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=int(args.vllm_block_size or 16),
        enable_prefix_caching=args.enable_prefix_caching, num_ring_snapshots=args.num_ring_snapshots,
        long_prefill_token_threshold=args.long_prefill_token_threshold, stream_interval=args.stream_interval,
        generation_config=args.vllm_generation_config or "auto", **_engine_args(args))
    step_timeout_s = args.engine_iteration_timeout_s
    step_timeout_s = DEFAULT_ENGINE_ITERATION_TIMEOUT_S if step_timeout_s is None else step_timeout_s
    if not step_timeout_s >= 0:
        raise ValueError(f"--engine-iteration-timeout-s must be >= 0, got {step_timeout_s}")
    check_port_free(server_config.host, server_config.port)          # before minutes of loading
    print(f"flint-sched: loading {model or 'flint-tiny'} (device {args.device}); a summary follows", file=sys.stderr,
          flush=True)
    state = load_engine_state(engine_config, args.scripted_executor, step_timeout_s)
    server_config = dataclasses.replace(server_config, sampling_defaults={     # the flag's over the checkpoint's
        **state.parts.sampling_defaults, **server_config.sampling_defaults})
    print_summary(state.parts, server_config)
    api_server_count = 0 if args.vllm_disable_frontend_multiprocessing else args.api_server_count
    if api_server_count is None:
        api_server_count = 1 if state.parts.device.type == "cuda" else 0
    if api_server_count:
        from flint_sched.api.api_process import serve_with_api_process

        return serve_with_api_process(state, server_config)
    return serve(state, server_config)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from flint_sched.benchmarks.latency import run
    return run(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from flint_sched.benchmarks.serve.main import run
    return run(args)


def _add_bench_parsers(sub) -> None:
    from flint_sched.benchmarks import latency
    from flint_sched.benchmarks.serve import main as serve
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("latency", help="decode step time and prefill throughput of the engine, no HTTP")
    latency.add_arguments(p)
    p.set_defaults(func=cmd_bench_latency)
    p = bench.add_parser("serve", help="load-test an OpenAI-compatible endpoint (as vllm bench serve)")
    serve.add_arguments(p)
    p.set_defaults(func=cmd_bench_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flint-sched", description="Serve the Flint model.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint")
    p.add_argument("--preset", required=True, choices=PRESETS)
    p.add_argument("--format", required=True, choices=("gguf-nvfp4", "hf-bf16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where to generate and quantize: cpu, cuda, auto")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("out", help="the .gguf file (gguf-nvfp4) or the directory (hf-bf16) to write")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("generate", help="generate text offline")
    p.set_defaults(parser=p)
    _add_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (flags as vLLM's)")
    p.set_defaults(parser=p)
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    _add_bench_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:                        # reported with the subcommand's usage, not the top level's
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"flint-sched: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
