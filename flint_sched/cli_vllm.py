"""vLLM's `serve` flags that flint-sched has no flag of its own for: each one is supported (does
here what it does in vLLM), ignored with a one-line notice (harmless here), or refused with the
reason. COMPAT_FLAGS is the single list: the CLI adds it to `serve`, docs/vllm.md tabulates it (a
test keeps the two in step), and `check` turns parsed values into notices or a refusal.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from flint_sched.checkpoint import generation_config

SUPPORTED, IGNORED, REFUSED = "supported", "ignored", "refused"


@dataclass(frozen=True)
class CompatFlag:
    names: tuple[str, ...]
    metavar: str | None          # None: a switch
    what_happens: str            # the docs' wording; also the notice or the refusal
    notice: str = ""             # the notice where what_happens has conditions in it

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


COMPAT_FLAGS = (
    CompatFlag(("--tensor-parallel-size", "-tp"), "N", "1: ignored (one GPU per server); more: refused",
               "ignored: one GPU per server"),
    CompatFlag(("--pipeline-parallel-size", "-pp"), "N", "1: ignored; more: refused (one GPU per server)",
               "ignored: one GPU per server"),
    CompatFlag(("--data-parallel-size", "-dp"), "N", "1: ignored; more: refused (run one server per GPU)",
               "ignored: one GPU per server"),
    CompatFlag(("--trust-remote-code",), None, "ignored: no remote code is ever run"),
    CompatFlag(("--disable-log-requests",), None, "ignored: requests are not logged"),
    CompatFlag(("--enable-log-requests",), None, "ignored: requests are not logged"),
    CompatFlag(("--disable-log-stats",), None, "ignored: no periodic stats log (see /metrics)"),
    CompatFlag(("--enable-prompt-tokens-details",), None,
               "ignored: usage always has prompt_tokens_details.cached_tokens, as OpenAI's"),
    CompatFlag(("--enable-chunked-prefill",), None, "ignored: prompts are always prefilled in chunks"),
    CompatFlag(("--max-logprobs",), "N", "supported, up to 20: the most logprobs a request may ask for"),
    CompatFlag(("--quantization", "-q"), "METHOD", "ignored: the checkpoint's format decides"),
    CompatFlag(("--swap-space",), "GIB", "ignored: no CPU swap of the KV cache"),
    CompatFlag(("--cpu-offload-gb",), "GIB", "0: ignored; more: refused (no weight offload)",
               "ignored: no weight offload"),
    CompatFlag(("--block-size",), "N", "supported: tokens per KV-cache block (16 if not given)"),
    CompatFlag(("--tokenizer-mode",), "MODE", "ignored: the tokenizer is always tokenizers' fast one"),
    CompatFlag(("--generation-config",), "PATH",
               "supported: auto (the default) takes the checkpoint's generation_config.json sampling fields as the "
               "defaults of requests that leave them out, as vLLM does; vllm: not; a folder: its file"),
    CompatFlag(("--max-seq-len-to-capture",), "N", "ignored: CUDA graphs cover every decode batch"),
    CompatFlag(("--distributed-executor-backend",), "NAME", "ignored: one process, one GPU"),
    CompatFlag(("--disable-custom-all-reduce",), None, "ignored: one GPU, no all-reduce"),
    CompatFlag(("--enable-expert-parallel",), None, "ignored: one GPU holds every expert"),
    CompatFlag(("--disable-frontend-multiprocessing",), None,
               "supported: the HTTP server runs in the engine's process (--api-server-count 0)"),
    CompatFlag(("--speculative-config",), "JSON", "refused: speculative decoding is not implemented"),
    CompatFlag(("--enable-lora",), None, "refused: LoRA adapters are not supported"),
    CompatFlag(("--lora-modules",), "NAME=PATH", "refused: LoRA adapters are not supported"),
    CompatFlag(("--allowed-origins",), "JSON", 'supported: CORS origins, a JSON list (default ["*"], as in vLLM)'),
    CompatFlag(("--allowed-methods",), "JSON", 'supported: CORS methods (default ["*"])'),
    CompatFlag(("--allowed-headers",), "JSON", 'supported: CORS headers (default ["*"])'),
    CompatFlag(("--allow-credentials",), None, "supported: CORS requests may carry credentials"),
    CompatFlag(("--root-path",), "PATH", "supported: the path prefix a proxy serves the API under"),
    CompatFlag(("--ssl-keyfile",), "PATH", "supported: HTTPS, with --ssl-certfile"),
    CompatFlag(("--ssl-certfile",), "PATH", "supported: HTTPS, with --ssl-keyfile"),
    CompatFlag(("--ssl-ca-certs",), "PATH",
               "supported: the CA certificates that client certificates are checked against"),
    CompatFlag(("--disable-uvicorn-access-log",), None, "supported: no access log line per request"),
    CompatFlag(("--enable-request-id-headers",), None,
               "supported: every response carries X-Request-Id (the request's own, or a new one)"),
    CompatFlag(("--enable-force-include-usage",), None,
               "supported: every stream ends with its usage chunk, asked for or not"),
    CompatFlag(("--disable-fastapi-docs",), None, "ignored: no /docs pages are served (GET /openapi.json is)"),
    CompatFlag(("--limit-mm-per-prompt",), "JSON",
               "ignored: the model reads text only (image and audio parts are refused per request)"),
    CompatFlag(("--compilation-config", "-O"), "JSON", "ignored: decode runs on our kernels from CUDA graphs"),
    CompatFlag(("--max-parallel-loading-workers",), "N", "ignored: the checkpoint is read by one process"),
    CompatFlag(("--structured-outputs-config", "--guided-decoding-backend"), "VALUE",
               "ignored: structured outputs always run on llguidance"),
    CompatFlag(("--enable-log-outputs",), None, "ignored: requests are not logged"),
    CompatFlag(("--enable-sleep-mode",), None, "refused: no sleep mode (the weights stay on the GPU)"),
    CompatFlag(("--tool-parser-plugin",), "PATH", "refused: no parser plugins (glm47 is built in)"),
    CompatFlag(("--hf-overrides",), "JSON", "refused: the model's configuration is not overridden"),
    CompatFlag(("--override-generation-config",), "JSON",
               "supported: sampling defaults for the fields a request leaves out (temperature, top_p, top_k, "
               "min_p, repetition_penalty; max_new_tokens caps a request that gives no max_tokens)"),
)

# vLLM flags that flint-sched has as flags of its own (docs/vllm.md lists them as supported)
NATIVE_FLAGS = (
    "--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--long-prefill-token-threshold", "--stream-interval", "--api-server-count",
    "--gpu-memory-utilization",
    "--hf-config-path",
    "--tokenizer", "--revision", "--tokenizer-revision", "--download-dir", "--load-format", "--dtype",
    "--kv-cache-dtype", "--seed", "--enforce-eager", "--async-scheduling",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--exclude-tools-when-tool-choice-none",
    "--chat-template", "--default-chat-template-kwargs", "--trust-request-chat-template", "--shutdown-timeout",
    "--uvicorn-log-level", "--device",
    "--enable-prefix-caching", "--no-enable-prefix-caching",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM compatibility", "accepted as vLLM spells them (docs/vllm.md)")
    for flag in COMPAT_FLAGS:
        if flag.metavar is None:
            group.add_argument(*flag.names, dest=flag.dest, action="store_const", const=True, default=None,
                               help=flag.what_happens)
        else:
            group.add_argument(*flag.names, dest=flag.dest, metavar=flag.metavar, default=None,
                               help=flag.what_happens)


def _int(flag: CompatFlag, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag.names[0]}: expected an integer, got {value!r}") from None


def _json_value(name: str, value: str, expected: type, what: str, each: type = object):
    """Flag `name`'s JSON value, of type `expected` (its items of type `each`); ValueError saying `what`."""
    try:
        loaded = json.loads(value)
    except json.JSONDecodeError:
        loaded = None
    if not isinstance(loaded, expected) or not all(isinstance(item, each) for item in loaded):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return loaded


def json_strings(name: str, value: str | None, default: tuple[str, ...] = ("*",)) -> tuple[str, ...]:
    """Flag `name`'s JSON list of strings (vLLM's CORS flags); the default when not given."""
    if value is None:
        return default
    return tuple(_json_value(name, value, list, "a JSON list of strings, e.g. '[\"*\"]'", str))


def generation_defaults(value: str | None) -> dict:
    """--override-generation-config's JSON object as the server's sampling defaults (its Hugging
    Face names: max_new_tokens is max_tokens); ValueError for anything else."""
    if value is None:
        return {}
    fields = _json_value("--override-generation-config", value, dict, "a JSON object")
    unknown = sorted(set(fields) - set(generation_config.FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: {unknown} are not sampling defaults here; known: "
                         f"{sorted(generation_config.FIELDS)}")
    return {generation_config.FIELDS[name]: value for name, value in fields.items()}


def check(args: argparse.Namespace) -> list[str]:
    """The notices for the vLLM flags given; ValueError (the reason) for one asking for what is not done."""
    notices = []
    for flag in COMPAT_FLAGS:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        spelled = flag.names[0] if value is True else f"{flag.names[0]} {value}"
        name = flag.names[0]
        if name in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"):
            if _int(flag, value) != 1:
                raise ValueError(f"{spelled}: this server runs the model on one GPU; serve with {name} 1 "
                                 "(or leave it out), one server per GPU")
        elif name == "--cpu-offload-gb":
            if float(value) != 0:
                raise ValueError(f"{spelled}: weights are never offloaded to the CPU; leave it out")
        elif name == "--block-size":
            if _int(flag, value) < 1:
                raise ValueError(f"{spelled}: must be a positive number of tokens")
            continue
        elif name == "--disable-frontend-multiprocessing":
            continue
        elif name == "--max-logprobs":
            if not 0 <= _int(flag, value) <= 20:
                raise ValueError(f"{spelled}: must be in [0, 20] (20 is the most this server computes)")
            continue
        elif name in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
            json_strings(name, value)
            continue
        elif name == "--override-generation-config":
            generation_defaults(value)
            continue
        elif flag.what_happens.startswith(SUPPORTED):
            continue
        elif flag.what_happens.startswith(REFUSED):
            raise ValueError(f"{spelled}: {flag.what_happens.removeprefix('refused: ')}")
        notices.append(f"{spelled}: {flag.notice or flag.what_happens}")
    return notices
