"""JSON log lines on stderr, each carrying the id of the request it belongs to."""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

# The id of the request being handled: set by api.core.observe for the request's task (and the threads it
# starts), read by every log line so lines of one request can be found together.
REQUEST_ID: ContextVar[str | None] = ContextVar("resiplan_request_id", default=None)

# Record attributes that are not `extra=` fields (uvicorn's color_message duplicates the message with ANSI codes).
_STANDARD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "color_message"}
_HANDLER_MARK = "_resiplan_json"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id (when in a request), any
    `extra=` fields, and the traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRIBUTES and key not in entry and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def json_handler(stream: Any = None) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    setattr(handler, _HANDLER_MARK, True)
    return handler


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr for the `resiplan` loggers; idempotent (the app factory may run many times)."""
    logger = logging.getLogger("resiplan")
    logger.setLevel(level.upper())
    if not any(getattr(handler, _HANDLER_MARK, False) for handler in logger.handlers):
        logger.addHandler(json_handler())


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's own lines (startup, errors) as JSON too; its access log is off, api.core.observe logs requests."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
