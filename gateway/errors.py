"""The errors the gateway's request path raises on purpose, and their gRPC status codes."""

from __future__ import annotations

import grpc

from canteen.auth import AuthenticationError, ModelNotAllowedError, PriorityNotAllowedError
from gateway.catalog import UnknownModelError
from gateway.limits import NeverFitsError, RateLimitedError


class InvalidInputError(ValueError):
    pass


class UpstreamError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code of an error the request path raises on purpose, else None."""
    if isinstance(exc, (InvalidInputError, NeverFitsError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UnknownModelError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (ModelNotAllowedError, PriorityNotAllowedError)):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, RateLimitedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, UpstreamError):
        return exc.code
    return None
