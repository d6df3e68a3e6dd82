"""Leader election through etcd, with fencing: one candidate leads while its lease lives.

    election = Election(etcd, "/exaserve/JOB", "rank1@n2", LeaseTiming.from_settings(10.0),
                        on_elected=start_plane, on_deposed=stop_acting).start()
    election.acting()              # the gate the controller reads before each decision (no I/O)
    election.fenced_put({key: v})  # a write that fails (Deposed) once another candidate leads

Campaign: grant a lease, then one txn puts PREFIX/leader bound to it if the key has no creator
(create_revision 0). The winner's create_revision is its fencing token: every write it makes is a txn
comparing the election key's create_revision with it, so a deposed leader's write fails even if it
has not noticed yet. The lease is renewed every `renew_interval`; when the pure lease_policy says the
lease may lapse before a renewal could land, `acting()` turns false by itself (computed from the clock
at each call, so a renewal stuck in a timeout cannot keep it true) and on_deposed runs. A standby
campaigns every `renew_interval`: it wins within lease_ttl + renew_interval of the leader's last
renewal, and etcd lets no one win before the old lease expired.

Metrics (exaserve_hpc/metrics.py, served on the process's gateway /metrics): while started, a candidate's
exaserve_ha_leader and exaserve_ha_lease_seconds_left are read at scrape time, without side effects (a
scrape never steps a leader down); exaserve_ha_elections_total and _fenced_writes_refused_total count here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from exaserve_hpc import metrics
from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable, KeyValue
from exaserve_hpc.ha.lease_policy import LeaderAction, LeaseTiming, act_deadline, leader_decision, seconds_left

log = logging.getLogger("exaserve.ha")


class Deposed(Exception):
    """This candidate is not (or no longer) the leader: its write was refused."""


class Election:
    def __init__(self, etcd: EtcdClient, prefix: str, candidate: str, timing: LeaseTiming,
                 on_elected: Callable[["Election"], None] = lambda e: None,
                 on_deposed: Callable[[str], None] = lambda why: None,
                 clock: Callable[[], float] = time.monotonic, info: Optional[dict] = None):
        self.etcd, self.prefix, self.candidate, self.timing = etcd, prefix.rstrip("/"), candidate, timing
        self.key = f"{self.prefix}/leader"
        self.on_elected, self.on_deposed, self.clock = on_elected, on_deposed, clock
        self.info = {"candidate": candidate, **(info or {})}
        self.lease = 0
        self.revision = 0          # our election key's create_revision while leading: the fencing token
        self.leading = False
        self.holder: Optional[KeyValue] = None  # who leads, as last seen
        self.elected_at: Optional[float] = None
        self.deposed_why = ""
        self._sent_at = 0.0        # when the last successful grant/renewal was sent (clock())
        self._granted = 0.0        # the TTL etcd answered it with
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"exaserve-election-{candidate}", daemon=True)
        self.labels = (candidate, str(self.info.get("node", "")))

    # ---------------------------------------------------------------- the gate

    def acting(self) -> bool:
        """True while this candidate leads and its lease is surely alive (the policy, at this moment)."""
        with self._lock:
            if not self.leading:
                return False
            if leader_decision(self.clock(), self._sent_at, self._granted, self.timing) is not LeaderAction.STEP_DOWN:
                return True
            late = self.clock() - self._sent_at
        # Past the deadline: step down now, from whoever asked (the controller's thread at its next decision),
        # not when the election thread's renewal, maybe stuck in a timeout, returns.
        self.step_down(f"lease not renewed for {late:.1f}s (TTL {self._granted:g}s, margin {self.timing.margin:g}s)")
        return False

    def seconds_left(self) -> float:
        """Until this candidate must stop acting (0 when not leading); no step-down, unlike acting()."""
        with self._lock:
            return seconds_left(self.clock(), self.leading, self._sent_at, self._granted, self.timing)

    def deadline(self) -> float:
        with self._lock:
            return act_deadline(self._sent_at, self._granted, self.timing)

    # ---------------------------------------------------------------- one step each

    def campaign_once(self) -> bool:
        """One attempt to lead; True when this candidate now leads."""
        sent = self.clock()
        lease, granted = self.etcd.grant(self.timing.ttl)
        won, kv = self.etcd.create_if_absent(self.key, json.dumps(self.info), lease)
        if not won:
            self.holder = kv
            try:
                self.etcd.revoke(lease)
            except EtcdUnavailable:
                pass  # it expires by itself
            return False
        with self._lock:
            self.lease, self.revision, self.holder = lease, kv.create_revision, kv
            self._sent_at, self._granted = sent, float(granted)
            self.leading, self.elected_at, self.deposed_why = True, self.clock(), ""
        metrics.HA_ELECTIONS.labels(*self.labels).inc()
        log.warning("%s leads (election key %s, revision %d, lease %x, TTL %ds)", self.candidate, self.key,
                    self.revision, lease, granted)
        return True

    def renew_once(self) -> None:
        """Renew the lease and check the election key is still ours; steps down when either is not so."""
        sent = self.clock()
        ttl = self.etcd.keepalive(self.lease)
        if ttl <= 0:
            self.step_down("the lease had expired when it was renewed")
            return
        current = self.etcd.get(self.key)
        if current is None or current.create_revision != self.revision:
            self.step_down("the election key is no longer ours")
            return
        with self._lock:
            if self.leading:
                self._sent_at, self._granted = sent, float(ttl)

    def step_down(self, why: str) -> None:
        with self._lock:
            if not self.leading:
                return
            self.leading, self.deposed_why = False, why
        log.error("%s stops leading: %s", self.candidate, why)
        self.on_deposed(why)

    def fenced_put(self, values: dict[str, bytes | str]) -> None:
        """Write as the leader, or raise Deposed (and step down when etcd says another leads)."""
        if not self.acting():
            raise Deposed(f"{self.candidate} is not acting as the leader")
        if not self.etcd.put_if_created_at(self.key, self.revision, values):
            metrics.HA_FENCED_WRITES_REFUSED.labels(*self.labels).inc()
            self.step_down("a fenced write was refused: another candidate holds the election key")
            raise Deposed(f"{self.candidate}: write refused, the election key {self.key} is no longer ours")

    def resign(self) -> None:
        """Give leadership up at once (a graceful stop): a standby need not wait for the lease to expire."""
        with self._lock:
            was, revision, lease = self.leading, self.revision, self.lease
        self.step_down("resigned")
        if was:
            try:
                self.etcd.delete_if_created_at(self.key, revision)
                self.etcd.revoke(lease)
            except EtcdUnavailable as exc:
                log.warning("resign: %s (the lease expires by itself)", exc)

    # ---------------------------------------------------------------- the thread

    def start(self) -> "Election":
        self.export_metrics()
        self._thread.start()
        return self

    def export_metrics(self) -> None:
        """This candidate's series on the process's /metrics, until stop()."""
        # read at scrape time: a gauge set by the election thread would show a stuck leader as leading
        metrics.HA_LEADER.labels(*self.labels).set_function(lambda: 1.0 if self.seconds_left() > 0 else 0.0)
        metrics.HA_LEASE_SECONDS_LEFT.labels(*self.labels).set_function(self.seconds_left)
        metrics.HA_ELECTIONS.labels(*self.labels)            # 0 from the start, so increase() sees the first win
        metrics.HA_FENCED_WRITES_REFUSED.labels(*self.labels)

    def stop(self, resign: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.timing.ttl)
        if resign:
            self.resign()
        for gauge in (metrics.HA_LEADER, metrics.HA_LEASE_SECONDS_LEFT):  # a stopped candidate shows none
            try:
                gauge.remove(*self.labels)
            except KeyError:
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.timing.renew_interval
            try:
                if not self.leading:
                    if self.campaign_once():
                        self.on_elected(self)
                        continue
                else:
                    action = leader_decision(self.clock(), self._sent_at, self._granted, self.timing)
                    if action is LeaderAction.STEP_DOWN:
                        self.step_down(f"lease not renewed for {self.clock() - self._sent_at:.1f}s "
                                       f"(TTL {self._granted:g}s, margin {self.timing.margin:g}s)")
                        continue
                    if action is LeaderAction.RENEW:
                        self.renew_once()
                    wait = max(0.05, min(self._sent_at + self.timing.renew_interval, self.deadline()) - self.clock())
            except EtcdUnavailable as exc:
                log.warning("%s: etcd: %s", self.candidate, exc)
                wait = min(wait, 0.5)
            except Exception:  # noqa: BLE001 - the election thread must outlive any one failure
                log.exception("%s: election round failed", self.candidate)
            self._stop.wait(wait)
