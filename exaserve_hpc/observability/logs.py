"""Log setup for every exaserve process: plain text (the default) or JSON lines.

    exaserve --log-format json serve          # or EXASERVE_LOG_FORMAT=json; children inherit it

A JSON line is one object: ts (UTC, ISO 8601 with milliseconds), level, logger, msg, pid, and where they
are known request_id (the id the gateway gives a request; the router and the replica receive the same id
in GenerateRequest, so one grep follows a request across processes), replica_id and node, then exc
(the traceback) when there is one. The request id comes from a log call's `extra={"request_id": ...}`
or, in the gateway, from `REQUEST_ID`, set for the task that serves the request.

With EXASERVE_LOG_DIR set (e.g. to the job directory's logs/ in the batch script), every process also
writes its own file there, ROLE.HOST.PID.log (role: rank<N> under Slurm, else exaserve; agent; replica),
capped at EXASERVE_LOG_MAX_BYTES (default 64 MiB) with one rotated predecessor kept: per-rank and
per-replica files next to srun's merged output, which a busy job can make unreadable.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.handlers
import os
import socket
import time
from pathlib import Path
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


DEFAULT_MAX_BYTES = 64 << 20


def configure_logging(level: Optional[str] = None, fmt: Optional[str] = None, text_format: str = TEXT_FORMAT,
                      role: Optional[str] = None) -> Optional[Path]:
    """Root logging for this process (level: argument, else EXASERVE_LOG_LEVEL, else WARNING; format: argument,
    else EXASERVE_LOG_FORMAT, else text, whose line is `text_format`); also to a file of its own under
    EXASERVE_LOG_DIR when set (see the module docstring), whose path is returned."""
    formatter = JsonLinesFormatter() if log_format(fmt) == "json" else logging.Formatter(text_format)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    path = None
    directory = os.environ.get("EXASERVE_LOG_DIR")
    if directory:
        if role is None:
            rank = os.environ.get("SLURM_PROCID")
            role = f"rank{rank}" if rank is not None else "exaserve"
        try:
            cap = int(os.environ.get("EXASERVE_LOG_MAX_BYTES", DEFAULT_MAX_BYTES))
        except ValueError:
            raise LogFormatError(f"EXASERVE_LOG_MAX_BYTES={os.environ['EXASERVE_LOG_MAX_BYTES']!r} is not a "
                                 "number of bytes (e.g. 67108864)") from None
        path = Path(directory) / f"{role}.{socket.gethostname()}.{os.getpid()}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(path, maxBytes=max(1024, cap), backupCount=1))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level or os.environ.get("EXASERVE_LOG_LEVEL", "WARNING"), handlers=handlers,
                        force=True)
    return path
