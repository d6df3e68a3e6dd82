"""The usage ledger: one line per finished request, appended durably, summed by `exaserve usage`.

Each gateway process appends JSON lines to a file of its own in the ledger directory
(``usage-<host>-<pid>-<start>.jsonl``, mode 0600), so processes never interleave and a restarted
or requeued gateway adds a new file beside the old ones: the totals continue, nothing is rewritten.

Durability: periodic fsync. Records are queued in memory and a writer thread appends and fsyncs
them in batches at most ``flush_interval`` (0.2 s) apart, and on close; a crash of the process
loses at most the requests finished in the last interval. A line torn by a crash mid-write is
skipped when reading (it is always the file's last).

A record: t (Unix time the request ended), request_id, group, account, model, prompt_tokens,
completion_tokens, gpu_seconds (the replica's GPUs x the request's time on it / the replica's batch
slots: the share of the replica one request held).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

log = logging.getLogger(__name__)

BY_CHOICES = ("account", "group", "model")


@dataclass(frozen=True)
class UsageRecord:
    t: float
    request_id: str
    group: str
    account: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    gpu_seconds: float


class UsageLedger:
    """Appends UsageRecords to this process's ledger file; ``record`` never blocks on the disk."""

    def __init__(self, directory: Path, flush_interval: float = 0.2):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = f"usage-{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}.jsonl"
        self.path = self.directory / name
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        _fsync_dir(self.directory)  # the new file's name survives a crash too
        self.flush_interval = flush_interval
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="exaserve-usage-ledger", daemon=True)
        self._thread.start()

    def record(self, record: UsageRecord) -> None:
        line = (json.dumps(asdict(record), separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._pending.append(line)
            closed = self._closed
        if closed:  # a request ending during shutdown: written at once
            self.flush()
        else:
            self._wake.set()

    def flush(self) -> None:
        """Write and fsync what is queued (the writer thread does this every flush_interval)."""
        with self._lock:
            batch, self._pending = self._pending, []
            if batch:
                os.write(self._fd, b"".join(batch))
                os.fsync(self._fd)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                self.flush()
            except OSError:
                log.exception("usage ledger %s: write failed; records kept for the next try", self.path)
            time.sleep(self.flush_interval)  # batches writes: one fsync per interval at most

    def close(self) -> None:
        """Flush and stop the writer thread; later records are written at once (the file stays open until exit,
        as requests the gateway still finishes during a shutdown are billed too)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------ reading and summing


def read_usage(directory: Path) -> Iterator[UsageRecord]:
    """Every record of every ledger file in the directory; a torn or foreign line is skipped."""
    for path in sorted(Path(directory).glob("usage-*.jsonl")):
        with open(path, "rb") as file:
            for line in file:
                try:
                    yield UsageRecord(**json.loads(line))
                except (ValueError, TypeError):
                    log.warning("usage ledger %s: skipping an unreadable line (a write cut by a crash)", path)


def summarize(records: Iterable[UsageRecord], by: str = "group", since: Optional[float] = None,
              until: Optional[float] = None) -> list[dict]:
    """Totals per account, group or model of the records ending in [since, until); pure."""
    if by not in BY_CHOICES:
        raise ValueError(f"--by is {by!r}; allowed: {', '.join(BY_CHOICES)}")
    rows: dict[str, dict] = {}
    for r in records:
        if (since is not None and r.t < since) or (until is not None and r.t >= until):
            continue
        key = getattr(r, by)
        row = rows.setdefault(key, {by: key, "requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                    "total_tokens": 0, "gpu_seconds": 0.0})
        row["requests"] += 1
        row["prompt_tokens"] += r.prompt_tokens
        row["completion_tokens"] += r.completion_tokens
        row["total_tokens"] += r.prompt_tokens + r.completion_tokens
        row["gpu_seconds"] += r.gpu_seconds
    for row in rows.values():
        row["gpu_seconds"] = round(row["gpu_seconds"], 6)
    return [rows[k] for k in sorted(rows)]


def ledger_dir(site, run_dir: Optional[Path] = None) -> Path:
    """site.usage_dir, else <run directory>/usage (run_dir: `exaserve serve`'s run directory, or under
    `exaserve launch` the job root, the parent of the job directories)."""
    if site.usage_dir:
        return Path(os.path.expandvars(site.usage_dir)).expanduser()
    return Path(run_dir or site.run_path) / "usage"


def default_ledger_dirs(site) -> list[Path]:
    """Where `exaserve usage` looks without --dir: usage_dir, else serve's <run_dir>/usage and the default
    job root's <run_dir>/jobs/usage (exaserve submit's JOB_ROOT)."""
    if site.usage_dir:
        return [ledger_dir(site)]
    return [ledger_dir(site), ledger_dir(site, site.run_path / "jobs")]
