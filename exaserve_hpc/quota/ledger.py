"""The usage ledger: one line per finished request, appended durably, summed by `exaserve usage`.

Each gateway process appends JSON lines to a file of its own in the ledger directory
(``usage-<host>-<pid>-<start ms>-<n>.jsonl``, n counting the ledgers this process made; mode 0600), so
ledgers never interleave and a restarted or requeued gateway adds a new file beside the old ones: the totals
continue, nothing is rewritten.

Durability: periodic fsync. Records are queued in memory and a writer thread appends and fsyncs
them in batches at most ``flush_interval`` (0.2 s) apart, and on close; a crash of the process
loses at most the requests finished in the last interval. A line torn by a crash mid-write is
skipped when reading (it is always the file's last).

The ledger also keeps, in memory, what the controller's checkpoint stores in its quota section
(``quota_state``): per group the tokens and requests billed in this ledger, the fair share's usage decayed
with its half-life (as Slurm's fair-share usage), and each ledger file's position (bytes) these cover.
A restarted or requeued run starts from the checkpoint's figures and reads only the ledger past those
positions (``restore``); without a checkpoint it reads the whole ledger. Every gateway of the process bills
through the one ledger, so one state covers them all.

A record: t (Unix time the request ended), request_id, group, account, model, prompt_tokens,
completion_tokens, gpu_seconds (the replica's GPUs x the request's time on it / the replica's batch
slots: the share of the replica one request held).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from exaserve_hpc.quota.shares import DecayedUsage

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


@dataclass
class QuotaState:
    """The checkpoint's quota section (controller_state.py): what the ledger held at Unix time ``at``."""
    totals: dict[str, tuple[int, int]]  # group -> (prompt + completion tokens, requests) billed
    usage: dict[str, float]             # group -> fair-share usage (tokens) decayed to ``at``
    at: float
    offsets: dict[str, int]             # ledger file name -> bytes of it the figures cover


class UsageLedger:
    """Appends UsageRecords to this process's ledger file; ``record`` never blocks on the disk."""

    def __init__(self, directory: Path, flush_interval: float = 0.2, half_life: float = 86400.0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path, self._fd = _create_file(self.directory)
        _fsync_dir(self.directory)  # the new file's name survives a crash too
        self.flush_interval = flush_interval
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.totals: dict[str, list[int]] = {}  # group -> [tokens, requests]; guarded by _lock like the rest
        self.usage = DecayedUsage(half_life)  # on Unix time (records' t)
        self.offsets: dict[str, int] = {self.path.name: 0}
        self._thread = threading.Thread(target=self._run, name="exaserve-usage-ledger", daemon=True)
        self._thread.start()

    def record(self, record: UsageRecord) -> None:
        line = (json.dumps(asdict(record), separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._pending.append(line)
            self._count(record)
            self.offsets[self.path.name] += len(line)  # lines reach the file in this order
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


    def _count(self, record: UsageRecord) -> None:
        tokens = record.prompt_tokens + record.completion_tokens
        totals = self.totals.setdefault(record.group, [0, 0])
        totals[0] += tokens
        totals[1] += 1
        self.usage.add(record.group, tokens, record.t)

    def quota_state(self) -> QuotaState:
        with self._lock:
            now = time.time()
            return QuotaState({g: (t, n) for g, (t, n) in self.totals.items()},
                              {g: self.usage.value(g, now) for g in self.usage.groups()}, now, dict(self.offsets))

    def restore(self, previous=None) -> int:
        """Start from a checkpoint's quota section (a controller_state.ControllerState, or None) and the ledger
        files past its positions (all of them without one); returns the records read."""
        records: list[UsageRecord] = []
        with self._lock:
            if previous is not None:
                for group, (tokens, requests) in previous.quota.items():
                    self.totals[group] = [tokens, requests]
                for group, usage in previous.quota_usage.items():
                    self.usage.add(group, usage, previous.quota_usage_at)
                self.offsets.update({k: v for k, v in previous.ledger_offsets.items() if k != self.path.name})
            for path in sorted(self.directory.glob("usage-*.jsonl")):
                if path.name != self.path.name:
                    self.offsets[path.name] = _read_tail(path, self.offsets.get(path.name, 0), records)
            for record in sorted(records, key=lambda r: r.t):  # decay needs time order
                self._count(record)
        return len(records)

    def seed(self, policy, now: float) -> None:
        """Give a gateway's fair share (shares.SharePolicy, on its own clock at ``now``) this ledger's usage."""
        state = self.quota_state()
        for group, usage in state.usage.items():
            policy.usage.add("" if group == "none" else group, usage, now)


def _read_tail(path: Path, offset: int, into: list) -> int:
    """Append the records of `path` from byte `offset` on to `into`; returns the position after the last whole
    line (a line still being written, or torn by a crash, is read again next time)."""
    with open(path, "rb") as file:
        file.seek(offset)
        data = file.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            into.append(UsageRecord(**json.loads(line)))
        except (ValueError, TypeError):
            log.warning("usage ledger %s: skipping an unreadable line (a write cut by a crash)", path)
    return offset + end


_created = itertools.count()  # ledgers of this process: two made in one millisecond still get files of their own


def _create_file(directory: Path) -> tuple[Path, int]:
    """A new ledger file of this process, opened for appending. O_EXCL: a name met again (a reused pid in the
    same millisecond after a requeue) takes the next number instead of appending to another ledger's file, whose
    byte positions that ledger counts."""
    while True:
        name = f"usage-{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}-{next(_created)}.jsonl"
        try:
            return directory / name, os.open(directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL,
                                             0o600)
        except FileExistsError:
            continue


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
