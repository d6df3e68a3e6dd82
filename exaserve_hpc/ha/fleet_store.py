"""The fleet's state in etcd: the checkpoint's content (placement, excluded nodes, rollouts, the quota section:
billed totals, fair-share usage, ledger positions; prefix affinity) under PREFIX/fleet/state, written only by the leader, read by its successor.

    write_state(election, prefix, state)      # fenced: Deposed once another candidate leads
    read_state(etcd, prefix)                  # ControllerState or None
    FleetStateWriter(election, prefix, keeper.state, interval=2.0).start()   # on change, and every `refresh`

JSON, not HDF5: the value is small (a few hundred bytes a replica; etcd takes requests up to 1.5 MiB by
default, which holds about 5,000 replicas' placement), and a standby decodes it without a file system.
The HDF5 checkpoint stays the requeue path's (controller_state.py); the two carry the same fields.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from exaserve_hpc.controller_state import ControllerState, RolloutState
from exaserve_hpc.ha.election import Deposed, Election
from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable

log = logging.getLogger("exaserve.ha")

FORMAT = "exaserve-fleet-state/1"


def state_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/fleet/state"


def _content(state: ControllerState) -> dict:
    """Everything but the time of writing: what decides whether the fleet changed."""
    return {"format": FORMAT, "job_id": state.job_id, "restart": state.restart,
            "placement": {r: list(v) for r, v in sorted(state.placement.items())},
            "affinity": {str(h): list(r) for h, r in sorted(state.affinity.items())},
            "quota": {g: list(v) for g, v in sorted(state.quota.items())},
            "quota_usage": dict(sorted(state.quota_usage.items())), "quota_usage_at": state.quota_usage_at,
            "ledger_offsets": dict(sorted(state.ledger_offsets.items())),
            "rollout": {m: [r.version, r.stage, r.weight] for m, r in sorted(state.rollout.items())},
            "excluded_nodes": sorted(state.excluded_nodes)}


def encode_state(state: ControllerState) -> bytes:
    return json.dumps({**_content(state), "saved_at": state.saved_at}, sort_keys=True).encode()


def decode_state(data: bytes) -> ControllerState:
    raw = json.loads(data)
    if raw.get("format") != FORMAT:
        raise ValueError(f"fleet state format {raw.get('format')!r}, expected {FORMAT!r}")
    return ControllerState(
        job_id=raw["job_id"], restart=int(raw["restart"]), saved_at=float(raw["saved_at"]),
        placement={r: (m, n) for r, (m, n) in raw["placement"].items()},
        affinity={int(h): list(r) for h, r in raw["affinity"].items()},
        quota={g: (int(t), int(n)) for g, (t, n) in raw["quota"].items()},
        quota_usage={g: float(u) for g, u in raw.get("quota_usage", {}).items()},
        quota_usage_at=float(raw.get("quota_usage_at", 0.0)),
        ledger_offsets={f: int(o) for f, o in raw.get("ledger_offsets", {}).items()},
        rollout={m: RolloutState(v, s, float(w)) for m, (v, s, w) in raw["rollout"].items()},
        excluded_nodes=list(raw["excluded_nodes"]))


def write_state(election: Election, prefix: str, state: ControllerState) -> None:
    election.fenced_put({state_key(prefix): encode_state(state)})


def read_state(etcd: EtcdClient, prefix: str) -> Optional[ControllerState]:
    kv = etcd.get(state_key(prefix))
    return decode_state(kv.value) if kv is not None else None


class FleetStateWriter:
    """The leader's thread: every `interval` seconds build the state; write it when it changed, or when
    `refresh` seconds passed since the last write. Stops writing for good once deposed."""

    def __init__(self, election: Election, prefix: str, build: Callable[[], ControllerState],
                 interval: float = 2.0, refresh: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.election, self.prefix, self.build = election, prefix, build
        self.interval, self.refresh, self.clock = interval, refresh, clock
        self.writes = 0
        self.written_at: Optional[float] = None
        self._last: Optional[dict] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-fleet-state", daemon=True)

    def start(self) -> "FleetStateWriter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def write_if_changed(self) -> bool:
        """One round; True when it wrote. Raises Deposed when this leader may not write any more."""
        state = self.build()
        content = _content(state)
        stale = self.written_at is None or self.clock() - self.written_at >= self.refresh
        if content == self._last and not stale:
            return False
        write_state(self.election, self.prefix, state)
        self._last, self.written_at = content, self.clock()
        self.writes += 1
        log.info("fleet state written to etcd (%d replicas placed, excluded %s)", len(state.placement),
                 ",".join(state.excluded_nodes) or "none")
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.write_if_changed()
            except Deposed as exc:
                log.warning("fleet state no longer written: %s", exc)
                return
            except EtcdUnavailable as exc:
                log.warning("fleet state not written: %s", exc)
            except Exception:  # noqa: BLE001 - a failed round must not end the writer
                log.exception("fleet state round failed")
            self._stop.wait(self.interval)
