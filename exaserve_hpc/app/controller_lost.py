"""Giving the job back when its controller is gone: rank 0's node lost without HA, or a batch host lost.

    code = agent.run()
    if code == EXIT_CONTROLLER_LOST:
        after_controller_lost(job, rank, jobdir, rank_0_node, requeue_on)  # an agent rank, no HA
    end_if_batch_host_lost(job, rank, jobdir, why)                        # the controller, after its stop

Without HA, every agent rank's agent exits after `heartbeat.controller_timeout` without word from the
controller. One surviving rank then acts: the first to create JOBDIR/controller-lost (an exclusive create
on the shared job directory, so exactly one acts however many time out at once; the file names it). It
asks the pure scheduler.requeue_policy.controller_lost_decision and either submits the successor job
(the batch script again, the controller's node excluded, resuming from the controller's last periodic
checkpoint, requeue.checkpoint_interval) or not, and in both cases cancels this job: its batch script ran
on rank 0's node, so Slurm would keep it RUNNING (`--no-kill`) until its time limit with no process left,
holding its nodes, and the successor depends on its end (afterany). A rank that cannot act says why and
exits as its agent did: the others' attempts are independent of it.

A job whose batch host is lost (always rank 0's node) cannot end by itself even when every rank exited,
HA or not: the controller that stops the run (an HA leader elected after that loss) cancels the job as
its last act, once its own stop is done, after looking up the batch host's node state in Slurm.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

from exaserve_hpc.controller_state import CHECKPOINT_FILE
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch import JobEnvError, JobEnvironment
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.controller.requeue_policy import ControllerLostDecision, controller_lost_decision

log = logging.getLogger("exaserve.requeue")

CLAIM_FILE = "controller-lost"  # in the job directory: the one rank that acts, and what it did
ENDED_FILE = "job-ended"  # the same for end_if_batch_host_lost


def claim(jobdir: JobDir, name: str, rank: RankInfo) -> bool:
    """Create JOBDIR/name exclusively, naming this rank; False when another rank already did."""
    try:
        fd = os.open(jobdir.path / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"rank": rank.rank, "node": rank.node, "at": time.time()}, f)
    return True


def checkpoint_age(jobdir: JobDir, now: Optional[float] = None) -> Optional[float]:
    try:
        written = (jobdir.path / CHECKPOINT_FILE).stat().st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - written)


def after_controller_lost(job: JobEnvironment, rank: RankInfo, jobdir: JobDir, controller_node: str,
                          requeue_enabled: bool) -> Optional[ControllerLostDecision]:
    """This rank's agent lost its controller (no HA): the first surviving rank gives the job back.
    Returns the decision it acted on, None when another rank acts."""
    if not claim(jobdir, CLAIM_FILE, rank):
        print(f"exaserve: rank {rank.rank} on {rank.node}: the controller is gone; another surviving rank gives "
              f"the job back ({jobdir.path / CLAIM_FILE})", flush=True)
        return None
    decision = controller_lost_decision(controller_node, requeue_enabled, job.can_requeue, checkpoint_age(jobdir))
    log.error("rank %d on %s: %s", rank.rank, rank.node, decision.why)
    print(f"exaserve: rank {rank.rank} on {rank.node}: {decision.why}", flush=True)
    why = decision.why
    if decision.action == "successor":
        try:
            outcome = job.requeue(list(decision.exclude), jobdir.path)
            why = outcome.detail
            print(f"exaserve: {outcome.detail}", flush=True)
            if outcome.how == "requeued":  # the same job back in the queue: Slurm ended this run already
                _record(jobdir, CLAIM_FILE, rank, outcome.how, why)
                return decision
        except JobEnvError as exc:
            why = f"the successor could not be submitted ({exc}); the job is cancelled so its nodes go back"
            log.error("%s", why)
            print(f"exaserve: {why}", flush=True)
    _record(jobdir, CLAIM_FILE, rank, decision.action, why)
    _end(job, why)
    return decision


def end_if_batch_host_lost(job: JobEnvironment, rank: RankInfo, jobdir: JobDir, why: str) -> bool:
    """The run stopped on this rank's controller: when the job's batch host is down, cancel the job (once),
    so it ends now and a successor waiting on it starts. True when it did."""
    if not job.batch_host_lost() or not claim(jobdir, ENDED_FILE, rank):
        return False
    reason = f"{why}; the job's batch host is down, so it cannot end by itself"
    print(f"exaserve: rank {rank.rank} on {rank.node}: {reason}: cancelling it", flush=True)
    _record(jobdir, ENDED_FILE, rank, "cancel", reason)
    _end(job, reason)
    return True


def _record(jobdir: JobDir, name: str, rank: RankInfo, action: str, why: str) -> None:
    (jobdir.path / name).write_text(json.dumps({"rank": rank.rank, "node": rank.node, "at": time.time(),
                                                "action": action, "why": why}))


def _end(job: JobEnvironment, why: str) -> None:
    try:
        job.end_job(why)
    except JobEnvError as exc:
        log.error("%s; the job holds its nodes until it is cancelled (scancel) or reaches its time limit", exc)
        print(f"exaserve: {exc}; cancel the job by hand (scancel)", flush=True)
