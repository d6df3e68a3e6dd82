"""Rank 0's requeue edge: checkpoint the controller's state into the job directory, then requeue the job.

Every `interval` seconds a thread builds a RequeueSnapshot from the controller's status, the job's time
limit and the job directory (a `requeue-requested` file is an operator's request), and asks the pure
scheduler.requeue.requeue_decision. On yes, once: the HDF5 checkpoint (checkpoint.py) is written to
JOB_DIR/controller-state.h5, then `scontrol update ExcNodeList=<lost> ; scontrol requeue` through the
SlurmClient seam. Slurm then ends this run; the next run's rank 0 restores from the checkpoint
(launch_rank.run_controller).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..checkpoint import ControllerState, save_state, state_from_status
from ..scheduler.replacement import replacement_decision
from ..scheduler.requeue import RequeueDecision, RequeuePolicy, RequeueSnapshot, requeue_decision
from .client import SlurmClient, SlurmError

log = logging.getLogger("exaserve.requeue")

CHECKPOINT_FILE = "controller-state.h5"
REQUEST_FILE = "requeue-requested"


def snapshot_from_status(status: dict, planned_nodes: list[str], controller_node: str,
                         seconds_left: Optional[float], requested: bool) -> RequeueSnapshot:
    agents = {a["agent_id"]: a["state"] for a in status.get("agents", [])}
    live = tuple(sorted(n for n, state in agents.items() if state == "alive"))  # replacements count too
    lost = tuple(sorted(n for n, state in agents.items() if state == "lost"))
    return RequeueSnapshot(planned_nodes=len(planned_nodes), live_nodes=live, lost_nodes=lost,
                           controller_node=controller_node, seconds_left=seconds_left, requested=requested)


class Requeuer:
    def __init__(self, controller, job_dir: Path, job_id: str, restart: int, client: SlurmClient,
                 planned_nodes: list[str], controller_node: str, policy: RequeuePolicy = RequeuePolicy(),
                 deadline: Optional[float] = None, interval: float = 1.0, clock: Callable[[], float] = time.time,
                 companions=None):
        """deadline: epoch seconds of the job's time limit (None: unknown). companions: a
        slurm.replacement.CompanionJobs to ask for replacement nodes when a node is lost (None: never)."""
        self.controller = controller
        self.job_dir = Path(job_dir)
        self.job_id, self.restart = job_id, restart
        self.client = client
        self.planned_nodes = list(planned_nodes)
        self.controller_node = controller_node
        self.policy = policy
        self.deadline = deadline
        self.interval = interval
        self.clock = clock
        self.companions = companions
        self.decision: Optional[RequeueDecision] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-requeue", daemon=True)

    @property
    def checkpoint_path(self) -> Path:
        return self.job_dir / CHECKPOINT_FILE

    def start(self) -> "Requeuer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.companions is not None:
            self.companions.cancel_all()  # the controller they serve is going away

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.decision is None:
            try:
                self.check()
            except Exception:  # a failed round must not end the watch; the next tick tries again
                log.exception("requeue check failed")

    def check(self) -> Optional[RequeueDecision]:
        """One round: decide, and act on a yes. Returns the decision acted on, else None."""
        seconds_left = None if self.deadline is None else self.deadline - self.clock()
        snapshot = snapshot_from_status(self.controller.status(), self.planned_nodes, self.controller_node,
                                        seconds_left, (self.job_dir / REQUEST_FILE).exists())
        decision = requeue_decision(snapshot, self.policy)
        if not decision.requeue:
            if self.companions is not None and len(snapshot.live_nodes) < snapshot.planned_nodes:
                self.replace(snapshot)
            return None
        self.decision = decision
        self.requeue(decision)
        return decision

    def replace(self, snapshot: RequeueSnapshot) -> None:
        joined = sum(n not in self.planned_nodes for n in snapshot.live_nodes)
        pending = max(0, self.companions.asked() - joined)
        decision = replacement_decision(snapshot.planned_nodes, len(snapshot.live_nodes), snapshot.lost_nodes,
                                        pending)
        if not decision.nodes:
            return
        companion = self.companions.submit(decision.nodes, decision.exclude)
        log.warning("%s; companion job %s", decision.why, companion)
        print(f"exaserve: {decision.why}; companion job {companion}", flush=True)

    def state(self, exclude: tuple[str, ...]) -> ControllerState:
        status = self.controller.status()
        previous = self.controller.restored
        excluded = sorted(set(exclude) | set(previous.excluded_nodes if previous else ()))
        state = state_from_status(status, self.job_id, self.restart, self.clock(), excluded)
        if previous is not None:  # what this run does not own yet is carried to the next one unchanged
            state.affinity, state.quota, state.rollout = previous.affinity, previous.quota, previous.rollout
        return state

    def requeue(self, decision: RequeueDecision) -> None:
        state = self.state(decision.exclude)
        save_state(self.checkpoint_path, state)
        log.error("requeue [%s]: %s; checkpoint %s (%d replicas); excluding %s", decision.reason.value,
                  decision.why, self.checkpoint_path, len(state.placement), state.excluded_nodes or "no node")
        print(f"exaserve: requeue [{decision.reason.value}] {decision.why}; checkpoint {self.checkpoint_path}; "
              f"excluding {','.join(state.excluded_nodes) or 'none'}", flush=True)
        (self.job_dir / REQUEST_FILE).unlink(missing_ok=True)
        if self.companions is not None:
            self.companions.cancel_all()
        try:
            self.client.requeue(int(self.job_id), state.excluded_nodes)
        except (SlurmError, ValueError) as exc:
            log.error("requeue of job %s failed: %s; the job runs on", self.job_id, exc)
            print(f"exaserve: requeue failed: {exc}", flush=True)
