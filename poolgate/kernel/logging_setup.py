"""Log setup shared by the long-running processes: plain text for people, one JSON object a line for log
pipelines. A request's log lines carry its ``x-request-id`` (Envoy's) so they join the access log."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id: ContextVar[str | None] = ContextVar("poolgate_request_id", default=None)
"""The ``x-request-id`` of the request being handled in this task (each ext_proc stream is its own task)."""


class RequestIdFilter(logging.Filter):
    """Stamps every record with the current request id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, request id, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """The usual text line, with ``[request_id]`` after the logger name when there is one."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid is None:
            return line
        head = f"{record.name}: "
        return line.replace(head, f"{record.name} [{rid}]: ", 1)


def configure_logging(level: str | int = "INFO", log_format: LogFormat = "text") -> None:
    """Replace the root logger's handlers with one stderr handler in ``log_format``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


def add_log_format_argument(parser: Any) -> None:
    """``--log-format json|text`` on an ``argparse`` parser (default text)."""
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="log lines as plain text (default) or one JSON object per line")
