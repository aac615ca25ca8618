"""The ASGI middleware around the app: the API key on `/v1`, and vLLM's X-Request-Id response header
(CORS is Starlette's; server.build_app stacks them)."""

from __future__ import annotations

import hmac
import uuid

from flint_sched.api import errors
from flint_sched.api.errors import error_response


def route_path(scope) -> str:
    """The request's path below --root-path (a proxy may or may not have cut the prefix off)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id (the request's own
    header, else a new id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """401 on `/v1/*` without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is not None and scope["type"] == "http" and route_path(scope).startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(errors.unauthorized(), {"www-authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
