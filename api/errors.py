"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with an HTTP status.

Every failure a handler can foresee is raised as an APIError and turned into this body by the app's
exception handlers; bad input is always a 4xx, never a 500. `type` and `code` follow OpenAI's API.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from flint_sched.api.protocol import ErrorInfo, ErrorResponse

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}
logger = logging.getLogger("flint_sched.api")
_MSGSPEC_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


class APIError(Exception):
    """A request that fails with `status`; `param` names the offending request field when known."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_OF_STATUS.get(status, "invalid_request_error")

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.error_type, param=self.param,
                                             code=self.code))


def error_response(error: APIError, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(error.to_body()), status_code=error.status,
                    media_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def invalid_json(error: msgspec.DecodeError) -> APIError:
    """A msgspec decode failure: malformed JSON, or a field of the wrong type (param from its path)."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {text}")
    match = _MSGSPEC_PATH.search(text)
    param = match.group(1) if match and match.group(1) else None
    return bad_request(f"invalid request: {text}", param)


def from_value_error(error: ValueError, fields: tuple[str, ...] = ()) -> APIError:
    """A ValueError from validation (SamplingParams, the engine); its first word names the field."""
    message = str(error)
    first = message.split(" ", 1)[0]
    return bad_request(message, first if first in fields else None)


def model_not_found(name: str) -> APIError:
    return APIError(400, f"The model `{name}` does not exist.", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
                    code="invalid_api_key")


def body_too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit_bytes} bytes", code="request_too_large")


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}")


def from_http_status(status: int, detail: str | None = None) -> APIError:
    """For Starlette's own errors (unknown route, wrong method)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    return APIError(status, detail or phrase)


async def _on_api_error(request: Request, error: APIError) -> Response:
    return error_response(error)


async def _on_http_error(request: Request, error: HTTPException) -> Response:
    return error_response(from_http_status(error.status_code))


async def _on_unexpected(request: Request, error: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(APIError(500, f"internal error: {error!r}"))


EXCEPTION_HANDLERS = {APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_unexpected}
