"""The HTTP edge's errors: OpenAI's error object, with the HTTP status mapped from the gRPC
code (DESIGN: 400/401/429/404/504/503)."""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from canteen.auth import AuthenticationError
from gateway.errors import InvalidInputError, status_of
from gateway.limits import RateLimitedError

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class HttpError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after: float = 0.0,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.retry_after, self.param = code, retry_after, param


def error_body(
    code: grpc.StatusCode, message: str, param: str | None = None
) -> tuple[int, dict[str, Any]]:
    """OpenAI's error object; ``param`` names the request field at fault, when one is."""
    status, kind = STATUS.get(code, (500, "internal_error"))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name}}


def error_response(exc: HttpError) -> web.Response:
    status, body = error_body(exc.code, str(exc), exc.param)
    headers = {"Retry-After": str(max(1, round(exc.retry_after + 0.5)))} if status == 429 else {}
    return web.json_response(body, status=status, headers=headers)


def as_http_error(exc: Exception) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, AuthenticationError):
        return HttpError(grpc.StatusCode.UNAUTHENTICATED, str(exc))
    if isinstance(exc, RateLimitedError):
        return HttpError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after)
    code = status_of(exc)
    if code is None:
        raise exc
    return HttpError(
        code, str(exc), param=exc.param if isinstance(exc, InvalidInputError) else None
    )
