"""What `serve` does before uvicorn starts: check the port (before the model loads), print the summary."""

from __future__ import annotations

import errno
import socket
import sys

from flint_sched.engine.builder import EngineParts
from flint_sched.engine.summary import format_summary


def check_port_free(host: str, port: int) -> None:
    """ValueError when `host:port` cannot be bound, so a taken port is said before minutes of loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use (another server?): stop it, or "
                                 "choose another with --port") from None
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def server_lines(config) -> dict[str, str]:
    """The summary's serving lines from a ServerConfig."""
    tools = (f"{config.tool_call_parser} (auto tool choice {'on' if config.enable_auto_tool_choice else 'off'})"
             if config.tool_call_parser else "none (tool calls come back as text)")
    return {
        "served as": ", ".join(config.served_model_names),
        "tool-call parser": tools,
        "reasoning parser": config.reasoning_parser or "none",
        "API key": "required" if config.api_key else "none",
        "sampling defaults": ", ".join(f"{k} {v}" for k, v in config.sampling_defaults.items()) + " (the "
                             "checkpoint's generation_config.json, --override-generation-config over it)"
                             if config.sampling_defaults else "vLLM's",
        "listening on": f"http://{config.host}:{config.port}",
    }


def print_summary(parts: EngineParts, config) -> None:
    print(format_summary(parts, server_lines(config), title="flint-sched serve"), file=sys.stderr, flush=True)
