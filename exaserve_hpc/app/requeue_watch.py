"""Rank 0's requeue edge: watch for a trigger, write the checkpoint, requeue through the job environment.

Every `interval` seconds a thread builds a RequeueSnapshot from the controller's status, the job's end
time (asked of the batch system at most every `end_time_refresh` seconds: an operator may move the
limit) and the job directory (a `requeue-requested` file is an operator's request), and asks the pure
scheduler.requeue_policy.requeue_decision. On yes, once: the controller's state is written (retried,
app/state_keeper.py), then jobenv's requeue() (same job back in the queue, or a successor job excluding
the lost nodes, after which this run stops by itself). On no, with replacement nodes on, the pure
scheduler.replacement_policy says how many nodes to ask the job environment for.

A `stop-requested` file newer than this run (the batch script's stop trap writes it) ends the run
gracefully, in case a stop signal did not reach rank 0. A failed round is logged and the next one
runs: nothing ends the watch but stop() or an acted-on decision.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc.config.schema import SiteConfig, resolve_site
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch import JobEnvError, JobEnvironment, RequeueOutcome
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.controller.replacement_policy import replacement_decision
from exaserve_hpc.controller.requeue_policy import RequeueDecision, RequeuePolicy, RequeueSnapshot, requeue_decision

log = logging.getLogger("exaserve.requeue")

REQUEST_FILE = "requeue-requested"
STOP_FILE = "stop-requested"


def snapshot_from_status(status: dict, planned_nodes: list[str], controller_node: str,
                         seconds_left: Optional[float], requested: bool) -> RequeueSnapshot:
    agents = {a["agent_id"]: a["state"] for a in status.get("agents", [])}
    # A silent node (past misses x interval, within heartbeat.grace) is not lost yet: it counts as live, so
    # no requeue is decided before the loss is, and the lost node is then in the exclusion.
    live = tuple(sorted(n for n, state in agents.items() if state in ("alive", "silent")))  # replacements too
    lost = tuple(sorted(n for n, state in agents.items() if state == "lost"))
    return RequeueSnapshot(planned_nodes=len(planned_nodes), live_nodes=live, lost_nodes=lost,
                           controller_node=controller_node, seconds_left=seconds_left, requested=requested)


class RequeueWatch:
    def __init__(self, controller, job: JobEnvironment, keeper, job_dir: Path, planned_nodes: list[str],
                 controller_node: str, policy: RequeuePolicy = RequeuePolicy(), replace_lost_nodes: bool = False,
                 interval: float = 2.0, end_time_refresh: float = 30.0, clock: Callable[[], float] = time.time,
                 request_stop: Callable[[str], None] = lambda why: None, requeue: bool = True):
        """keeper: a state_keeper.StateKeeper. request_stop(why): ends this run gracefully (the
        control plane's stop), called after a successor job was submitted or on a stop file.
        requeue: False watches the stop file only (requeue off, or a job environment that cannot)."""
        self.requeue_enabled = requeue
        self.stop_requested = False
        self.controller = controller
        self.job = job
        self.keeper = keeper
        self.job_dir = Path(job_dir)
        self.planned_nodes = list(planned_nodes)
        self.controller_node = controller_node
        self.policy = policy
        self.replace_lost_nodes = replace_lost_nodes
        self.interval = interval
        self.end_time_refresh = end_time_refresh
        self.clock = clock
        self.request_stop = request_stop
        self.started = clock()
        self.decision: Optional[RequeueDecision] = None
        self.outcome: Optional[RequeueOutcome] = None
        self._end_time: Optional[float] = None
        self._end_time_read = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-requeue", daemon=True)

    def start(self) -> "RequeueWatch":
        self._thread.start()
        return self

    def stop(self, release: bool = True) -> None:
        """release=False: a deposed leader's watch (ha/), whose companion jobs are the new leader's now."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)
        if not release:
            return
        try:
            self.job.release_requests()  # companions outliving their controller would hold nodes for nothing
        except JobEnvError as exc:
            log.warning("cannot release the replacement nodes: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.decision is None:
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed round must not end the watch; the next one tries again
                log.exception("requeue check failed; checking again in %.0fs", self.interval)

    def end_time(self) -> Optional[float]:
        now = self.clock()
        if now - self._end_time_read >= self.end_time_refresh:
            self._end_time_read = now
            try:
                self._end_time = self.job.end_time()
            except JobEnvError as exc:
                log.warning("%s; keeping the last known end time", exc)
        return self._end_time

    def stop_file_requested(self) -> bool:
        try:
            return (self.job_dir / STOP_FILE).stat().st_mtime >= self.started - 1.0
        except OSError:
            return False

    def check(self) -> Optional[RequeueDecision]:
        """One round: decide, and act on a yes. Returns the decision acted on, else None."""
        if not self.stop_requested and self.stop_file_requested():
            self.stop_requested = True
            log.warning("%s appeared in %s: stopping gracefully", STOP_FILE, self.job_dir)
            self.request_stop(f"{STOP_FILE} in the job directory")
        if not self.requeue_enabled:
            return None
        end = self.end_time() if self.policy.time_margin > 0 else None
        snapshot = snapshot_from_status(self.controller.status(), self.planned_nodes, self.controller_node,
                                        None if end is None else end - self.clock(),
                                        (self.job_dir / REQUEST_FILE).exists())
        decision = requeue_decision(snapshot, self.policy)
        if not decision.requeue:
            if self.replace_lost_nodes and len(snapshot.live_nodes) < snapshot.planned_nodes:
                self.replace(snapshot)
            return None
        self.decision = decision
        self.requeue(decision)
        return decision

    def replace(self, snapshot: RequeueSnapshot) -> None:
        joined = sum(n not in self.planned_nodes for n in snapshot.live_nodes)
        pending = max(0, self.job.requested_nodes() - joined)
        decision = replacement_decision(snapshot.planned_nodes, len(snapshot.live_nodes), snapshot.lost_nodes,
                                        pending)
        if not decision.nodes:
            return
        try:
            request = self.job.request_nodes(decision.nodes, decision.exclude)
        except JobEnvError as exc:
            log.error("%s; not asked: %s", decision.why, exc)
            return
        log.warning("%s; companion job %s", decision.why, request)
        print(f"exaserve: {decision.why}; companion job {request}", flush=True)

    def requeue(self, decision: RequeueDecision) -> None:
        written = self.keeper.save(decision.exclude)
        excluded = sorted(self.keeper.excluded)
        where = self.keeper.path if written else "NOT WRITTEN (the next run starts from the site's plan)"
        log.error("requeue [%s]: %s; checkpoint %s; excluding %s", decision.reason.value, decision.why, where,
                  ",".join(excluded) or "no node")
        print(f"exaserve: requeue [{decision.reason.value}] {decision.why}; checkpoint {where}; "
              f"excluding {','.join(excluded) or 'none'}", flush=True)
        (self.job_dir / REQUEST_FILE).unlink(missing_ok=True)
        try:
            self.job.release_requests()
            self.outcome = self.job.requeue(excluded, self.job_dir)
        except JobEnvError as exc:
            log.error("%s; the job runs on", exc)
            print(f"exaserve: requeue failed: {exc}", flush=True)
            return
        print(f"exaserve: {self.outcome.detail}", flush=True)
        if self.outcome.stop_now:
            self.request_stop(self.outcome.detail)


def requeue_policy(site: SiteConfig, args: argparse.Namespace):
    """The site's requeue triggers, each overridden by its flag when given."""
    r = site.requeue
    return RequeuePolicy(capacity_floor=r.capacity_floor if args.capacity_floor is None else args.capacity_floor,
                         time_margin=r.time_margin if args.time_margin is None else args.time_margin)


def start_requeue_watch(plane, site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                        nodes: list[str], args: argparse.Namespace):
    """Watch for a requeue trigger (controller/requeue_policy.py) when the job environment can requeue,
    and in any case for the batch script's stop-requested file."""
    requeue = not args.no_requeue and site.requeue.enabled and job.can_requeue
    replace = requeue and (site.requeue.replace_lost_nodes if args.replace_lost_nodes is None
                           else args.replace_lost_nodes)
    if replace:
        job.enable_node_requests(site, resolve_site(args.site), jobdir.path)
    return RequeueWatch(plane.controller, job, plane.keeper, jobdir.path, nodes, rank.node,
                        requeue_policy(site, args), replace_lost_nodes=replace,
                        request_stop=plane.request_stop, requeue=requeue).start()
