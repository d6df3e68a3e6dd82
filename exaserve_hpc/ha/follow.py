"""Agents follow the leader: the job directory's controller.json names the controller of the moment; when a
new leader publishes itself there, every agent re-registers with it (NodeAgent.follow).

    LeaderFollower(agent, jobdir, rank).start()

Polling a small file on the shared job directory every `interval` seconds costs one stat and read per node;
an agent that missed a change by a few seconds only delays its hello, and `heartbeat.controller_timeout`
counts from the last controller heard, so a failover shorter than it loses no agent.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from exaserve_hpc.bootstrap import ControllerInfo
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.transport import load_client_keys

log = logging.getLogger("exaserve.ha")


def current_controller(jobdir: JobDir, rank: RankInfo) -> Optional[ControllerInfo]:
    """The controller this run's controller.json names, or None (none yet, another run's, or a failed start)."""
    data = jobdir.read_json("controller.json")
    if not data or data.get("job_id") != rank.job_id or data.get("restart") != rank.restart:
        return None
    try:
        info = ControllerInfo(**data)
    except TypeError:
        return None
    return info if info.endpoint and not info.error else None


def failed_start(jobdir: JobDir, rank: RankInfo) -> str:
    """Why this run's first leader could not start its controller ("" when it did, or has not tried yet)."""
    data = jobdir.read_json("controller.json")
    if not data or data.get("job_id") != rank.job_id or data.get("restart") != rank.restart:
        return ""
    return str(data.get("error") or "")


class LeaderFollower:
    def __init__(self, agent, jobdir: JobDir, rank: RankInfo, interval: float = 0.5):
        self.agent, self.jobdir, self.rank, self.interval = agent, jobdir, rank, interval
        self.changes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-follow-leader", daemon=True)

    def start(self) -> "LeaderFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """One look; True when the agent moved to another controller."""
        info = current_controller(self.jobdir, self.rank)
        if info is None or info.endpoint == self.agent.controller:
            return False
        key = load_client_keys(self.jobdir, info.server_public_key).server_public if info.server_public_key else b""
        self.agent.follow(info.endpoint, key)
        self.changes += 1
        print(f"exaserve: rank {self.rank.rank} on {self.rank.node}: agent follows the leader at {info.endpoint}",
              flush=True)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the next look tries again
                log.exception("following the leader failed")
