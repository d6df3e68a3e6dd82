"""Agent side of weight loading: fills the node's L2 from L3, once per model, with timeout and retries.

Call protocol (the agent's loop is the only caller; ``now`` is its clock):
- ``request(model, model_dir, holder, now)`` -> Ticket: ``ready`` (an L2 hit,
  already pinned for ``holder``) or filling (``holder`` waits; replicas of
  the same model share one fill, so the node reads L3 once). Raises
  CheckpointError if the manifest cannot be read, L2Full if the entry cannot
  fit (the caller then loads straight from L3).
- ``poll(now)`` -> finished fills as FillResult: ok (every waiter pinned) or
  failed with a reason. An attempt past its deadline is cancelled and
  retried, ``retries`` times; then it fails with "load_timeout".
- ``forget(holder)`` when a waiter stops wanting the model; ``close()`` cancels all.

Each attempt copies in a thread (reads and hashing release the GIL, so the
agent keeps heartbeating); a timed-out attempt is cancelled between chunks.
A read stuck inside the kernel cannot be interrupted from Python: its
thread is abandoned and its partial directory removed when it returns.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from exaserve_hpc.cache.checkpoint import CheckpointError, ChecksumError
from exaserve_hpc.cache.l2_shm import READY, L2Cache, L2Full, entry_key
from exaserve_hpc.cache.l3_store import LoadCancelled, copy_verified, read_manifest
from exaserve_hpc.agent import faults

PREFETCH = ""  # the holder name of a prefetch (no replica waits)


@dataclass
class Ticket:
    key: str
    path: Path
    ready: bool
    nbytes: int


@dataclass
class FillResult:
    key: str
    model: str
    waiters: set[str]
    ok: bool
    attempts: int
    reason: str = ""  # "load_timeout" | "checksum" | "checkpoint" | "io"
    detail: str = ""


@dataclass
class _Attempt:
    """One try at copying; its thread writes only here, so a late thread cannot touch the next try."""
    number: int
    deadline: float
    fill_dir: Path
    cancel: threading.Event = field(default_factory=threading.Event)
    outcome: Optional[BaseException] = None
    finished: bool = False
    read: int = 0  # bytes read from L3


@dataclass
class _Fill:
    key: str
    model: str
    model_dir: str
    nbytes: int
    timeout: float
    waiters: set[str] = field(default_factory=set)
    current: Optional[_Attempt] = None

    @property
    def attempts(self) -> int:
        return self.current.number if self.current else 0


def default_timeout(nbytes: int, floor: float = 30.0, slowest_rate: float = 100e6) -> float:
    """Seconds one L3 -> L2 attempt may take: the floor plus the size at the slowest acceptable rate."""
    return floor + nbytes / slowest_rate


class WeightLoader:
    def __init__(self, cache: L2Cache, retries: int = 3, copy: Callable = copy_verified):
        self.cache = cache
        self.retries = retries
        self._copy = copy
        self._fills: dict[str, _Fill] = {}

    def request(self, model: str, model_dir: str, holder: str, now: float, timeout: float = 0.0) -> Ticket:
        entries, raw = read_manifest(model_dir)
        key = entry_key(model, raw)
        nbytes = sum(e.size for e in entries)
        entry = self.cache.entries.get(key)
        if entry is not None and entry.state == READY:
            if holder != PREFETCH:
                self.cache.pin(key, holder, now)
                self.cache.hits += 1
            else:
                entry.last_used = now
            return Ticket(key, self.cache.path(key), True, nbytes)
        fill = self._fills.get(key)
        if fill is None:
            fill = _Fill(key, model, model_dir, nbytes, timeout or default_timeout(nbytes))
            self._start_attempt(fill, now)  # L2Full here: nothing started, the caller reads L3 directly
            self._fills[key] = fill
        fill.waiters.add(holder)
        return Ticket(key, self.cache.path(key), False, nbytes)

    def progress(self, key: str) -> tuple[int, int]:
        entry = self.cache.entries.get(key)
        return (entry.done, entry.nbytes) if entry is not None else (0, 0)

    def forget(self, holder: str) -> None:
        for fill in self._fills.values():
            fill.waiters.discard(holder)

    def poll(self, now: float) -> list[FillResult]:
        results = []
        for fill in list(self._fills.values()):
            attempt = fill.current
            if attempt.finished:
                self.cache.l3_bytes_read += attempt.read
                error = attempt.outcome
                if error is None:
                    self.cache.finish_fill(fill.key, attempt.fill_dir, now)
                    for holder in fill.waiters - {PREFETCH}:
                        self.cache.pin(fill.key, holder, now)
                    results.append(self._done(fill, True))
                else:
                    self.cache.abort_fill(fill.key, attempt.fill_dir)
                    reason = ("checksum" if isinstance(error, ChecksumError)
                              else "checkpoint" if isinstance(error, CheckpointError) else "io")
                    results.append(self._done(fill, False, reason, f"{type(error).__name__}: {error}"))
            elif now > attempt.deadline:
                attempt.cancel.set()
                self.cache.l3_bytes_read += attempt.read
                self.cache.abort_fill(fill.key, attempt.fill_dir)
                if attempt.number > self.retries:
                    results.append(self._done(fill, False, "load_timeout",
                                              f"L3 -> L2 copy of {fill.model_dir} did not finish within "
                                              f"{fill.timeout:.1f}s in {attempt.number} attempts; the shared "
                                              "store is slow or hung on this node"))
                    continue
                try:
                    self._start_attempt(fill, now)
                except L2Full as e:
                    results.append(self._done(fill, False, "l2_full", str(e)))
        return results

    def close(self) -> None:
        for fill in self._fills.values():
            fill.current.cancel.set()
            self.cache.abort_fill(fill.key, fill.current.fill_dir)
        self._fills.clear()

    # ------------------------------------------------------------ attempts

    def _done(self, fill: _Fill, ok: bool, reason: str = "", detail: str = "") -> FillResult:
        del self._fills[fill.key]
        return FillResult(fill.key, fill.model, set(fill.waiters), ok, fill.attempts, reason, detail)

    def _start_attempt(self, fill: _Fill, now: float) -> None:
        fill_dir = self.cache.begin_fill(fill.key, fill.model, fill.nbytes, now)
        attempt = _Attempt(fill.attempts + 1, now + fill.timeout, fill_dir)
        fill.current = attempt
        threading.Thread(target=self._run, args=(fill, attempt, self.cache.entries[fill.key]),
                         name=f"l2-fill-{fill.model}-{attempt.number}", daemon=True).start()

    def _run(self, fill: _Fill, attempt: _Attempt, entry) -> None:
        def on_progress(done: int, total: int) -> None:
            if not attempt.cancel.is_set():
                entry.done = done

        def on_chunk(n: int) -> None:
            attempt.read += n
            faults.check("l3_read")

        try:
            if faults.stalls(attempt.number):
                attempt.cancel.wait()
                raise LoadCancelled(f"injected hang of attempt {attempt.number}")
            self._copy(fill.model_dir, attempt.fill_dir, progress=on_progress, cancel=attempt.cancel,
                       on_chunk=on_chunk)
            attempt.outcome = None
        except BaseException as e:  # reported by poll() on the agent's thread
            attempt.outcome = e
        if attempt.cancel.is_set():  # abandoned (timed out or closed): whatever it left is garbage
            shutil.rmtree(attempt.fill_dir, ignore_errors=True)
            return
        attempt.finished = True
