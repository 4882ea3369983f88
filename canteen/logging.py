"""Structured logging: JSON lines when not on a terminal, readable lines on one.

Every line carries the service name; lines about one request carry its ``request_id``
(bound with ``structlog.contextvars`` in the handler that serves it).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("CANTEEN_LOG_LEVEL", "INFO")).upper()
    numeric = logging.getLevelNamesMapping().get(level_name)
    if numeric is None:
        raise ValueError(f"log level={level_name!r}: use DEBUG, INFO, WARNING or ERROR")
    renderer: structlog.typing.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.EventRenamer("msg"),
            _bind_service(service),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (print() makes two when stderr is a file): processes that
        # share a stderr, as `canteen up` and its children do, never split each other's lines.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _bind_service(service: str) -> structlog.typing.Processor:
    def processor(
        _logger: object, _name: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.setdefault("service", service)
        return event

    return processor


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger
