"""The batch system `exaserve launch` runs under, behind one interface (jobenv.base.JobEnvironment).

    job = detect_job_environment()     # SlurmJobEnvironment inside a Slurm job, else LocalJobEnvironment
    rank = job.rank_info()             # rank, size, node, job id, restart count
    job.end_time()                     # epoch seconds the batch system ends the job (None: no limit)
    job.requeue(exclude=["n3"], ...)   # come back later, not on n3
    job.request_nodes(1, exclude=[])   # one more node, whose agent joins the running controller

A PBS or Flux port is one module with one JobEnvironment subclass, added to ENVIRONMENTS.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from exaserve_hpc.batch.base import JobEnvError, JobEnvironment, RequeueOutcome, RESUME_VARIABLE
from exaserve_hpc.batch.local import LocalJobEnvironment
from exaserve_hpc.batch.slurm.job import SlurmJobEnvironment

# First match wins; the local environment matches everything.
ENVIRONMENTS: tuple[type[JobEnvironment], ...] = (SlurmJobEnvironment, LocalJobEnvironment)


def detect_job_environment(env: Optional[Mapping[str, str]] = None, **kwargs) -> JobEnvironment:
    env = os.environ if env is None else env
    for kind in ENVIRONMENTS:
        if kind.detects(env):
            return kind(env, **kwargs)
    raise JobEnvError("no job environment matched")  # unreachable: the local one always matches


__all__ = ["ENVIRONMENTS", "JobEnvError", "JobEnvironment", "LocalJobEnvironment", "RESUME_VARIABLE",
           "RequeueOutcome", "SlurmJobEnvironment", "detect_job_environment"]
