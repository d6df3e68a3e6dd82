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
per-replica files next to srun's merged output, which a busy job can make unreadable. The files are 0600
from their first byte (whatever the umask), and their directory 0700 when made here.

Repeated warnings and errors are rate-limited on every handler (RepeatFilter): at most 5 lines of one
kind per 10 s (EXASERVE_LOG_REPEAT_INTERVAL; 0: off), then one line with the count of the rest.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.handlers
import os
import socket
import threading
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
REPEAT_INTERVAL = 10.0  # seconds; EXASERVE_LOG_REPEAT_INTERVAL overrides (0: no rate limit)
REPEAT_BURST = 5        # lines of one kind let through per interval before the rest are only counted
_MAX_KINDS = 4096


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler whose files are 0600 from their first byte, whatever the umask (the log is
    opened before `serve` / `launch` set theirs) and also after a rotation."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a file left by an earlier process of the same name
        except OSError:
            pass
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8", errors=self.errors)


class RepeatFilter(logging.Filter):
    """Rate-limits repeated warnings and errors on one handler: of one kind (logger, level, the message's
    template, the exception's type) at most REPEAT_BURST lines per interval pass; the rest are counted,
    and the count is written as one line ("N more like this were suppressed ...") when that kind is next
    logged after its interval or when any later line comes after it. A flood of one failure (a traceback
    per failed accept, a line per malformed frame) costs a few lines per interval, not the disk.
    INFO and DEBUG lines are never limited. One instance per handler (each counts what it writes)."""

    def __init__(self, handler: Optional[logging.Handler] = None, interval: Optional[float] = None,
                 burst: int = REPEAT_BURST, clock=time.monotonic):
        super().__init__()
        if interval is None:
            try:
                interval = float(os.environ.get("EXASERVE_LOG_REPEAT_INTERVAL", REPEAT_INTERVAL))
            except ValueError:
                interval = REPEAT_INTERVAL
        self.handler, self.interval, self.burst, self.clock = handler, interval, burst, clock
        self._kinds: dict[tuple, list] = {}  # kind -> [window start, lines passed, suppressed, a record of it]
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return record.name, record.levelno, str(record.msg)[:200], exc

    def filter(self, record: logging.LogRecord) -> bool:
        if self.interval <= 0 or record.levelno < logging.WARNING or getattr(record, "_exaserve_summary", False):
            return True
        now = self.clock()
        due: list[tuple[logging.LogRecord, int, float]] = []
        with self._lock:
            key = self.kind(record)
            entry = self._kinds.get(key)
            if entry is not None and now - entry[0] >= self.interval:
                if entry[2]:
                    due.append((entry[3], entry[2], now - entry[0]))
                entry = None
            if entry is None:
                if len(self._kinds) >= _MAX_KINDS:
                    self._kinds.clear()
                entry = self._kinds[key] = [now, 0, 0, record]
            if entry[1] < self.burst:
                entry[1] += 1
                passed = True
            else:
                entry[2] += 1
                entry[3] = record
                passed = False
            if now >= self._next_sweep:  # other kinds whose interval ended with lines still only counted
                self._next_sweep = now + self.interval / 4
                for other, e in list(self._kinds.items()):
                    if other != key and now - e[0] >= self.interval:
                        if e[2]:
                            due.append((e[3], e[2], now - e[0]))
                        del self._kinds[other]
        for last, count, seconds in due:
            self._summary(last, count, seconds)
        return passed

    def _summary(self, last: logging.LogRecord, count: int, seconds: float) -> None:
        if self.handler is None:
            return
        line = logging.LogRecord(last.name, last.levelno, last.pathname, last.lineno,
                                 "%d more like this were suppressed in the last %.0fs (repeated log lines are "
                                 "rate-limited); the latest: %s", (count, seconds, last.getMessage()[:500]),
                                 None)
        line._exaserve_summary = True
        self.handler.handle(line)


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
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handlers.append(PrivateRotatingFileHandler(path, maxBytes=max(1024, cap), backupCount=1))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(RepeatFilter(handler))
    logging.basicConfig(level=level or os.environ.get("EXASERVE_LOG_LEVEL", "WARNING"), handlers=handlers,
                        force=True)
    return path
