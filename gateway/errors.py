"""The errors the gateway's request path raises on purpose, and their gRPC status codes."""

from __future__ import annotations

import grpc

from canteen.auth import AuthenticationError, ModelNotAllowedError, PriorityNotAllowedError
from gateway.catalog import UnknownModelError
from gateway.limits import NeverFitsError, RateLimitedError
from gateway.prep_pool import PrepBusyError, PrepDeadlineError


class InvalidInputError(ValueError):
    """A caller's mistake; ``param`` is the request field it concerns (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def clip(value: object, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that echo input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refuse_unknown(
    where: str, value: dict[str, object], known: frozenset[str], on: str = ""
) -> None:
    """Refuses the first key of ``value`` not in ``known``, naming its path (400); ``on``
    says where, as in " on a 'user' message"."""
    for key in value:
        if key not in known:
            param = f"{where}.{key[:64]}" if where else key[:64]
            raise InvalidInputError(
                f"{param}: not supported{on} by this server; remove the field "
                f"(supported: {', '.join(sorted(known))})",
                param=param,
            )


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
    if isinstance(exc, (RateLimitedError, PrepBusyError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, PrepDeadlineError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, UpstreamError):
        return exc.code
    return None
