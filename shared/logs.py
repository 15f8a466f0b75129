"""Structured logs: one JSON object per line on stderr, with the request id when one is bound.

Every service configures logging once, at process start, through `configure_logging`. Log
lines carry the service and instance so lines from many processes can be merged; the request
id comes from a context variable, so it follows a request through `await`s and tasks created
while it is bound (asyncio copies the context into new tasks) without being passed around.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import sys
from types import TracebackType
from typing import Any

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshllm_request_id", default=None
)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted.
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "color_message", "taskName"}
)


class bind_request_id:
    """Bind `request_id` to the current context.

    Usable as a plain call (the id stays bound for the rest of the current task) or as a
    context manager (the previous id is restored on exit).
    """

    def __init__(self, request_id: str | None) -> None:
        self._token = _request_id.set(request_id)

    def __enter__(self) -> bind_request_id:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _request_id.reset(self._token)


def current_request_id() -> str | None:
    return _request_id.get()


class JsonFormatter(logging.Formatter):
    """Formats a record as a single JSON line; never raises on odd `extra` values."""

    def __init__(self, service: str, instance: str) -> None:
        super().__init__()
        self.service = service
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "service": self.service,
            "instance": self.instance,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or _request_id.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal, with the request id when bound."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = _request_id.get()
        return f"{line} [request_id={request_id}]" if request_id else line


def configure_logging(
    service: str, instance: str, level: str = "INFO", log_json: bool = True
) -> None:
    """Route every logger (uvicorn's included) to one stderr handler on the root logger.

    Replaces existing root handlers, so calling it twice does not duplicate lines.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, instance) if log_json else TextFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
