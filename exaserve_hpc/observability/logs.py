"""Log setup for every exaserve process: plain text (the default) or JSON lines.

    exaserve --log-format json serve          # or EXASERVE_LOG_FORMAT=json; children inherit it

A JSON line is one object: ts (UTC, ISO 8601 with milliseconds), level, logger, msg, pid, and where they
are known request_id (the id the gateway gives a request; the router and the replica receive the same id
in GenerateRequest, so one grep follows a request across processes), replica_id and node, then exc
(the traceback) when there is one. The request id comes from a log call's `extra={"request_id": ...}`
or, in the gateway, from `REQUEST_ID`, set for the task that serves the request.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from typing import Optional

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
REQUEST_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("exaserve_request_id", default=None)
_FIELDS = ("request_id", "replica_id", "node")


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "msg": record.getMessage(), "pid": record.process}
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is None and name == "request_id":
                value = REQUEST_ID.get()
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class LogFormatError(ValueError):
    pass


def log_format(value: Optional[str] = None) -> str:
    """The format asked for (argument, else EXASERVE_LOG_FORMAT, else text), checked."""
    chosen = (value or os.environ.get("EXASERVE_LOG_FORMAT") or "text").lower()
    if chosen not in FORMATS:
        raise LogFormatError(f"log format {chosen!r} (--log-format or EXASERVE_LOG_FORMAT) is not one of "
                             f"{', '.join(FORMATS)}")
    return chosen


def configure_logging(level: Optional[str] = None, fmt: Optional[str] = None, text_format: str = TEXT_FORMAT) -> None:
    """Root logging for this process (level: argument, else EXASERVE_LOG_LEVEL, else WARNING; format: argument,
    else EXASERVE_LOG_FORMAT, else text, whose line is `text_format`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLinesFormatter() if log_format(fmt) == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level or os.environ.get("EXASERVE_LOG_LEVEL", "WARNING"), handlers=[handler],
                        force=True)
