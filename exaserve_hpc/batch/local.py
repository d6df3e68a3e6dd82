"""No batch system: one rank on this machine (or MPI's ranks under mpirun), no time limit, no requeue.

EXASERVE_JOB_END_TIME (epoch seconds), when set, stands in for a batch system's end time, so the
time-margin trigger can be exercised without one.
"""

from __future__ import annotations

from typing import Mapping, Optional

from exaserve_hpc.batch.base import JobEnvironment


class LocalJobEnvironment(JobEnvironment):
    name = "local"

    @classmethod
    def detects(cls, env: Mapping[str, str]) -> bool:
        return True

    def task(self) -> tuple[int, int, str, str, int]:
        return 0, 1, self.env.get("EXASERVE_NODE_NAME") or self.hostname(), "local", 0

    def end_time(self) -> Optional[float]:
        value = self.env.get("EXASERVE_JOB_END_TIME")
        return float(value) if value else None
