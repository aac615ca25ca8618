"""The OpenAI-compatible HTTP server: `build_app(engine_state, server_config)` and the uvicorn runner.

The engine is made and started inside the app's lifespan (so on the server's event loop) and shut
down with it; with `--api-server-count 1` the app runs in a process of its own and its "engine" is
an EngineClient of the engine process's (api/api_process.py, engine/remote.py). Every error leaves
as OpenAI's error body; `/v1/*` needs the API key when one is set, every other route stays open.
Request bodies are read up to `max_request_body_bytes` (else 413). The event loop only routes:
decoding, validating, rendering and tokenizing a request run on the `prepare` threads
(`ServingContext.off_loop`). Shutdown and engine death: lifecycle.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import msgspec
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from flint_sched import __version__
from flint_sched.api import errors
from flint_sched.api.gc_pauses import PauseWatch, freeze_startup_heap
from flint_sched.api.lifecycle import FlintServer, Lifecycle
from flint_sched.api.limits import check_json_depth, check_text_fits, max_chars_per_token
from flint_sched.api.metrics import CONTENT_TYPE, ServerMetrics
from flint_sched.api.middleware import APIKeyMiddleware, RequestIdHeaderMiddleware
from flint_sched.api.openapi import openapi_document
from flint_sched.api.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from flint_sched.api.protocol import SAMPLING_DEFAULTS, ModelCard, ModelList, VersionResponse, decode_request
from flint_sched.api.serving_chat import create_chat_completion
from flint_sched.api.serving_completions import create_completion
from flint_sched.api.serving_responses import ResponseStore, create_response, retrieve_response
from flint_sched.api.serving_tokenization import detokenize, tokenize
from flint_sched.api.tool_choice import ToolFlags
from flint_sched.engine.config import EngineConfig
from flint_sched.sampling_params import SamplingParams
from flint_sched.tokenizer import default_chat_template

if TYPE_CHECKING:
    from flint_sched.engine.builder import EngineParts

logger = logging.getLogger("flint_sched.api")
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_ENGINE_ITERATION_TIMEOUT_S = 300.0     # NOTE: a GPU's first steps compile kernels and capture graphs
NUM_PREPARE_THREADS = 4


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and treats requests; validated when built, files already read."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("flint-tiny",)
    api_key: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    chat_template: str | None = None                 # the template text; None: the checkpoint's or ours
    default_chat_template_kwargs: Mapping = field(default_factory=dict)
    trust_request_chat_template: bool = False        # vLLM's: a request's own `chat_template` is rendered
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_level: str = "info"
    max_logprobs: int = 20                           # vLLM's --max-logprobs: the most a request may ask for
    # vLLM's CORS defaults (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""                              # vLLM's --root-path: a proxy's prefix
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    access_log: bool = True                          # off: vLLM's --disable-uvicorn-access-log
    request_id_headers: bool = False                 # vLLM's --enable-request-id-headers
    force_include_usage: bool = False                # vLLM's --enable-force-include-usage
    # vLLM's --override-generation-config: sampling fields a request leaves out (SAMPLING_DEFAULTS'
    # names), and max_tokens: the most a request that gives none may generate
    sampling_defaults: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served model names must be non-empty")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; known: {TOOL_CALL_PARSER_NAMES}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: {REASONING_PARSER_NAMES}")
        check_sampling_defaults(self.sampling_defaults)
        object.__setattr__(self, "sampling_defaults", MappingProxyType(dict(self.sampling_defaults)))
        if not isinstance(self.default_chat_template_kwargs, Mapping):
            raise ValueError("default chat template kwargs must be a JSON object")
        object.__setattr__(self, "default_chat_template_kwargs",
                           MappingProxyType(dict(self.default_chat_template_kwargs)))
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")

    @property
    def tool_flags(self) -> ToolFlags:
        return ToolFlags(self.enable_auto_tool_choice, self.tool_call_parser, self.exclude_tools_when_tool_choice_none)


def check_sampling_defaults(defaults: Mapping) -> None:
    """ValueError unless `defaults` holds SAMPLING_DEFAULTS' fields and max_tokens, each valid."""
    unknown = set(defaults) - set(SAMPLING_DEFAULTS) - {"max_tokens"}
    if unknown:
        raise ValueError(f"generation config: unknown sampling fields {sorted(unknown)}; known: "
                         f"{sorted([*SAMPLING_DEFAULTS, 'max_tokens'])}")
    try:
        SamplingParams(**defaults)                   # its own checks, its messages
    except ValueError as error:
        raise ValueError(f"sampling defaults (--override-generation-config): {error}") from None


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself when it is an inline Jinja template."""
    if value is None:
        return None
    if Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja template")


class EngineState:
    """The parts an engine is built from (loaded before serving) and the engine once started."""

    def __init__(self, parts: EngineParts, model_root: str,
                 step_timeout_s: float | None = DEFAULT_ENGINE_ITERATION_TIMEOUT_S):
        if step_timeout_s is not None and not step_timeout_s >= 0:
            raise ValueError(f"engine iteration timeout must be >= 0 seconds, got {step_timeout_s}")
        self.parts = parts
        self.model_root = model_root
        self.step_timeout_s = step_timeout_s
        self.tokenizer = parts.checkpoint.tokenizer
        self.max_model_len = parts.scheduler_config.max_model_len
        self.vocab_size = parts.checkpoint.config.vocab_size
        self.grammar_compiler = parts.grammar_compiler   # what a request compiles here, the engine's steps find
        self.engine = None

    async def start(self) -> None:
        from flint_sched.engine.builder import build_engine

        self.engine = build_engine(self.parts)
        self.engine.step_timeout_s = self.step_timeout_s
        self.engine.start()

    async def refresh_stats(self) -> None:
        """Nothing to fetch: this engine's stats are read live at scrape time."""

    async def stop(self) -> None:
        if self.engine is None:
            return
        await self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_running


@dataclass
class ServingContext:
    """What every handler reads: the engine, the flags, the metrics, the chat template."""

    state: EngineState
    config: ServerConfig
    metrics: ServerMetrics
    chat_template: str
    lifecycle: Lifecycle
    created: int = field(default_factory=lambda: int(time.time()))
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        NUM_PREPARE_THREADS, thread_name_prefix="flint-prepare"))
    responses: ResponseStore = field(default_factory=ResponseStore)     # /v1/responses with store: true

    def __post_init__(self) -> None:
        self.chars_per_token = max_chars_per_token(self.state.tokenizer)

    def encode(self, text: str, param: str | None = None, keep_last: int | None = None) -> list[int]:
        """Prompt text to ids (off the loop): refused unread when it surely cannot fit the context;
        keep_last (truncate_prompt_tokens): only its last that many ids, however long the text."""
        if keep_last is None:
            check_text_fits(text, self.chars_per_token, self.max_model_len, param)
        ids = self.tokenizer.encode(text)           # off the GIL, so the loop keeps routing
        return ids if keep_last is None else ids[-keep_last:]

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on a prepare thread: anything that grows with the request's size goes here."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, fn, *args)

    @property
    def engine(self):
        if not self.state.is_healthy:
            engine = self.state.engine
            raise errors.unavailable(repr(engine.dead_error) if engine is not None and engine.dead_error
                                     else "the engine is not running")
        return self.state.engine

    @property
    def tokenizer(self):
        return self.state.tokenizer

    @property
    def grammar_compiler(self):
        """Where a request's grammar is compiled (off the loop); in-process, the engine's own cache."""
        return self.state.grammar_compiler

    @property
    def max_model_len(self) -> int:
        return self.state.max_model_len

    def model_name(self, requested: str | None) -> str:
        """The model a request names (None: the first served name); 400 for any other."""
        if requested is None:
            return self.config.served_model_names[0]
        if requested not in self.config.served_model_names:
            raise errors.model_not_found(requested)
        return requested

    def max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int:
        """The completion budget: as requested, or what the context leaves (vLLM's default)."""
        if requested is not None:
            return requested
        left = self.max_model_len - num_prompt_tokens
        if left < 1:
            raise errors.bad_request(f"this model's maximum context length is {self.max_model_len} tokens, but "
                                     f"the prompt has {num_prompt_tokens}")
        return min(left, self.config.sampling_defaults.get("max_tokens", left))

    @staticmethod
    def decode(body: bytes, schema):
        """The typed request (call it off the loop); 400 for bad JSON, deep nesting or wrong types."""
        check_json_depth(body)
        try:
            return decode_request(body, schema)
        except msgspec.DecodeError as error:
            raise errors.invalid_json(error) from error
        except RecursionError as error:                  # NOTE: a smaller thread stack than expected
            raise errors.bad_request("the request body nests JSON too deeply") from error


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, or 413 past `limit_bytes` (after draining a bounded rest, so the client
    reads the answer instead of a reset connection)."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            too_large = True
        if too_large:
            if size > 8 * limit_bytes + (64 << 20):
                break
            continue
        chunks.append(chunk)
    if too_large:
        raise errors.body_too_large(limit_bytes)
    return b"".join(chunks)


def _post(handler):
    async def endpoint(request: Request) -> Response:
        ctx: ServingContext = request.app.state.ctx
        if ctx.lifecycle.draining:
            raise errors.unavailable("the server is shutting down")
        try:
            body = await read_body(request, ctx.config.max_request_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)             # the client left while sending: nobody to answer
        return await handler(ctx, request, body)
    return endpoint


def _get(handler):
    async def endpoint(request: Request) -> Response:
        return handler(request.app.state.ctx)
    return endpoint


def _get_async(handler):
    async def endpoint(request: Request) -> Response:
        return await handler(request.app.state.ctx)
    return endpoint


def _json(payload) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def list_models(ctx: ServingContext) -> Response:
    cards = [ModelCard(id=name, created=ctx.created, root=ctx.state.model_root, max_model_len=ctx.max_model_len)
             for name in ctx.config.served_model_names]
    return _json(ModelList(data=cards))


def health(ctx: ServingContext) -> Response:
    return Response(status_code=200 if ctx.state.is_healthy and not ctx.lifecycle.draining else 503)


async def metrics(ctx: ServingContext) -> Response:
    await ctx.state.refresh_stats()
    return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE)


def reset_prefix_cache(ctx: ServingContext) -> Response:
    """vLLM's POST /reset_prefix_cache: forget every cached prefix (running requests keep theirs)."""
    ctx.engine.reset_prefix_cache()
    return Response(status_code=200)


def version(ctx: ServingContext) -> Response:
    return _json(VersionResponse(version=__version__))


def openapi(ctx: ServingContext) -> Response:
    return Response(openapi_document(), media_type="application/json")


class InvocationFields(msgspec.Struct):
    """What tells an invocation's kind (the values left unread; empty where absent)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()


async def invocations(ctx: ServingContext, request: Request, body: bytes) -> Response:
    """vLLM's (SageMaker's) POST /invocations: a chat request (`messages`), a completions request
    (`prompt`) or a responses request (`input`), by its fields."""
    fields = await ctx.off_loop(ctx.decode, body, InvocationFields)
    for given, handler in ((fields.messages, create_chat_completion), (fields.prompt, create_completion),
                           (fields.input, create_response)):
        if given:
            return await handler(ctx, request, body)
    raise errors.bad_request("an invocation is a chat (`messages`), completions (`prompt`) or responses (`input`) "
                             "request")


def build_app(engine_state: EngineState, server_config: ServerConfig, lifecycle: Lifecycle | None = None) -> Starlette:
    """The Starlette app; its lifespan starts the engine on the serving loop and stops it after."""
    metrics_ = ServerMetrics(server_config.served_model_names[0], lambda: engine_state.engine)
    template = server_config.chat_template or engine_state.tokenizer.chat_template or default_chat_template()
    lifecycle = lifecycle or Lifecycle(server_config.shutdown_timeout_s)
    ctx = ServingContext(engine_state, server_config, metrics_, template, lifecycle)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        lifecycle.loop = asyncio.get_running_loop()
        await engine_state.start()
        lifecycle.spawn(lifecycle.supervise(engine_state.engine))
        freeze_startup_heap()                   # before the first request: see api/gc_pauses.py
        gc_watch = PauseWatch()
        gc_watch.install()
        try:
            yield
        finally:
            gc_watch.remove()
            await engine_state.stop()
            ctx.prepare_pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/chat/completions", _post(create_chat_completion), methods=["POST"]),
        Route("/v1/completions", _post(create_completion), methods=["POST"]),
        Route("/v1/responses", _post(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/models", _get(list_models), methods=["GET"]),
        Route("/tokenize", _post(tokenize), methods=["POST"]),
        Route("/detokenize", _post(detokenize), methods=["POST"]),
        Route("/health", _get(health), methods=["GET"]),
        Route("/ping", _get(health), methods=["GET", "POST"]),        # vLLM's (SageMaker's) alias of /health
        Route("/invocations", _post(invocations), methods=["POST"]),  # vLLM's (SageMaker's): by the body
        Route("/metrics", _get_async(metrics), methods=["GET"]),
        Route("/reset_prefix_cache", _get(reset_prefix_cache), methods=["POST"]),
        Route("/version", _get(version), methods=["GET"]),
        Route("/openapi.json", _get(openapi), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=errors.EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(APIKeyMiddleware, api_key=server_config.api_key)
    if server_config.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    # outermost, as in vLLM: a browser's preflight is answered before the key is asked for
    app.add_middleware(CORSMiddleware, allow_origins=list(server_config.allowed_origins),
                       allow_methods=list(server_config.allowed_methods),
                       allow_headers=list(server_config.allowed_headers),
                       allow_credentials=server_config.allow_credentials)
    return app


def load_engine_state(engine_config: EngineConfig, scripted_executor: str | None = None,
                      step_timeout_s: float | None = DEFAULT_ENGINE_ITERATION_TIMEOUT_S) -> EngineState:
    """Load the model (making flint-tiny into the cache on first use, with a progress bar); with a
    script file, a ScriptedExecutor replays it instead of running the model (tests only)."""
    from flint_sched.engine.builder import build_parts

    parts = build_parts(engine_config, progress=True)
    if scripted_executor is not None:
        from flint_sched.api.scripted_executor import ScriptedExecutor

        executor = ScriptedExecutor.from_file(scripted_executor, parts.checkpoint.tokenizer)
        parts = dataclasses.replace(parts, executor=executor)
    return EngineState(parts, str(engine_config.model or "flint-tiny"), step_timeout_s)


def serve(engine_state: EngineState, server_config: ServerConfig) -> int:
    """Serve until a signal drains the server (0) or the engine dies (EXIT_ENGINE_DIED)."""
    import uvicorn

    lifecycle = Lifecycle(server_config.shutdown_timeout_s)
    app = build_app(engine_state, server_config, lifecycle)
    # http="auto": httptools (a dependency) parses HTTP/1.1, not h11: at 256 streams ~20 µs less
    # server CPU per streamed token (benchmarks/RESULTS.md, session 10)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.log_level, timeout_graceful_shutdown=5,
                            root_path=server_config.root_path, access_log=server_config.access_log,
                            ssl_keyfile=server_config.ssl_keyfile, ssl_certfile=server_config.ssl_certfile,
                            ssl_ca_certs=server_config.ssl_ca_certs)
    FlintServer(config, lifecycle, lambda: engine_state.engine).run()
    return lifecycle.exit_code
