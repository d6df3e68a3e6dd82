"""Writing the controller's state: periodically, before a requeue, and once more when the fleet stops.

    keeper = StateKeeper(controller, run_dir / CHECKPOINT_FILE, job_id, restart, interval=300)
    keeper.start()                 # a thread writes every `interval` seconds (0: never periodically)
    keeper.save(exclude=("n3",))   # now, retried; True when written (never by a controller not acting: ha/)
    keeper.stop()                  # the thread ends; the final write is the shutdown order's (app/control_plane.py)
    keeper.quota = ledger.quota_state  # the quota section's source (quota/ledger.py), once the gateway has one

A write that fails (a full or briefly unreachable shared filesystem) is logged with its cause and
retried `attempts` times with a growing pause; a failed round never ends the periodic thread. Nodes
once excluded stay excluded in every later write, so the stop's write keeps what a requeue decided.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from exaserve_hpc.controller_state import ControllerState, save_state, state_from_status

log = logging.getLogger("exaserve.state")


class StateKeeper:
    def __init__(self, controller, path: Path, job_id: str, restart: int, interval: float = 0.0,
                 attempts: int = 3, backoff: float = 1.0, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep,
                 save: Callable[[Path, ControllerState], Path] = save_state):
        self.controller = controller
        self.path = Path(path)
        self.job_id, self.restart = job_id, restart
        self.interval = interval
        self.attempts = max(1, attempts)
        self.backoff = backoff
        self.clock, self.sleep, self._save = clock, sleep, save
        self.excluded: set[str] = set()
        self.quota: Optional[Callable[[], object]] = None  # -> quota.ledger.QuotaState; None: carried over
        self.saved_at: Optional[float] = None  # clock() of the last successful write
        self.failures = 0  # failed attempts so far (status, tests)
        self._lock = threading.Lock()  # one write at a time: the periodic thread, a requeue, the stop
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def state(self, exclude: Iterable[str] = ()) -> ControllerState:
        previous = getattr(self.controller, "restored", None)
        self.excluded |= set(exclude) | set(previous.excluded_nodes if previous else ())
        state = state_from_status(self.controller.status(), self.job_id, self.restart, self.clock(),
                                  sorted(self.excluded))
        if previous is not None:  # what this run does not own yet is carried to the next one unchanged
            state.affinity, state.quota, state.rollout = previous.affinity, previous.quota, previous.rollout
            state.quota_usage, state.quota_usage_at = previous.quota_usage, previous.quota_usage_at
            state.ledger_offsets = previous.ledger_offsets
        if self.quota is not None:  # the usage ledger's figures (it restored the previous run's first)
            quota = self.quota()
            state.quota, state.quota_usage, state.quota_usage_at = quota.totals, quota.usage, quota.at
            state.ledger_offsets = quota.offsets
        return state

    def save(self, exclude: Iterable[str] = ()) -> bool:
        """Write now; retried. False (after logging every failure) when no attempt succeeded, or when this
        controller no longer acts as the leader (ha/: a deposed leader's state is stale; the new leader writes)."""
        with self._lock:
            for attempt in range(1, self.attempts + 1):
                if not self._acting():  # checked again before a retry: the lease may lapse during a pause
                    log.warning("checkpoint %s not written: this controller is not acting as the leader", self.path)
                    return False
                try:
                    state = self.state(exclude)
                    self._save(self.path, state)
                except Exception as exc:  # noqa: BLE001 - any failure is logged and retried, never fatal
                    self.failures += 1
                    log.error("checkpoint %s: attempt %d/%d failed: %s: %s", self.path, attempt, self.attempts,
                              type(exc).__name__, exc)
                    if attempt < self.attempts:
                        self.sleep(self.backoff * 2 ** (attempt - 1))
                    continue
                self.saved_at = self.clock()
                log.info("checkpoint %s written (%d replicas, excluding %s)", self.path, len(state.placement),
                         ",".join(state.excluded_nodes) or "none")
                return True
        log.error("checkpoint %s not written after %d attempts; the next write tries again", self.path,
                  self.attempts)
        return False

    def _acting(self) -> bool:
        """The controller's HA gate (controller/loop.py: always true without ha.etcd)."""
        acting = getattr(self.controller, "acting", None)
        return True if acting is None else bool(acting())

    def start(self) -> "StateKeeper":
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="exaserve-checkpoint", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.save()
            except Exception:  # noqa: BLE001 - save() logs its own failures; this is the last guard
                log.exception("periodic checkpoint failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(10)
