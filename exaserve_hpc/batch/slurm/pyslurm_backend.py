"""The pyslurm backend: used only when pyslurm imports and its version matches the running Slurm.

pyslurm on PyPI is 25.11 (built against Slurm 25.11 headers); Debian 12 ships
Slurm 22.05, so on the machines we test on this module does not import and
`slurm_client()` picks the CLI. Reads go through pyslurm's 23.02+ object API;
what it does not wrap (requeue with excluded nodes, sbatch of a file) falls
back to the CLI client, so both backends answer the same interface with the
same enums.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pyslurm  # noqa: F401  (ImportError here is how the factory learns pyslurm is unusable)

from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmClient, SlurmError
from exaserve_hpc.batch.slurm.parse import JobInfo, NodeInfo
from exaserve_hpc.batch.slurm.states import job_state, node_state


def pyslurm_version() -> str:
    return str(getattr(pyslurm, "__version__", "0.0"))


class PyslurmClient(SlurmClient):
    backend = "pyslurm"

    def __init__(self, fallback: CliSlurmClient):
        self.fallback = fallback

    def submit(self, script: Path, options: Sequence[str] = ()) -> int:
        return self.fallback.submit(script, options)

    def jobs(self, job_ids: Sequence[int] = (), user: Optional[str] = None) -> list[JobInfo]:
        try:
            loaded = pyslurm.Jobs.load()
        except Exception as exc:  # pyslurm raises its own RPCError
            raise SlurmError(f"pyslurm could not load jobs: {exc}") from exc
        out = []
        for job in loaded.values():
            if job_ids and job.id not in job_ids:
                continue
            if user and getattr(job, "user_name", None) != user:
                continue
            nodes = tuple(pyslurm.utils.expand_range_str(job.nodes)) if getattr(job, "nodes", None) else ()
            out.append(JobInfo(job_id=job.id, name=job.name or "", state=job_state(job.state),
                               raw_state=str(job.state), reason=job.state_reason or "", nodes=nodes,
                               node_count=job.num_nodes or 0, partition=job.partition or "",
                               account=job.account or "", qos=job.qos or "",
                               restarts=job.requeue_count or 0, requeue=bool(job.is_requeueable),
                               batch_host=job.batch_host or "",
                               time_limit_s=None if not job.time_limit else job.time_limit * 60))
        return out

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        try:
            loaded = pyslurm.Nodes.load()
        except Exception as exc:
            raise SlurmError(f"pyslurm could not load nodes: {exc}") from exc
        return [NodeInfo(name=n.name, state=node_state(n.state), raw_state=str(n.state), reason=n.reason or "",
                         cpus=n.total_cpus or 0, alloc_cpus=n.allocated_cpus or 0,
                         partitions=tuple(n.partitions or ()), hostname=n.hostname or "", port=n.port or 0)
                for n in loaded.values() if not names or n.name in names]

    def update_job(self, job_id: int, **fields: str) -> None:
        self.fallback.update_job(job_id, **fields)

    def requeue(self, job_id: int) -> None:
        self.fallback.requeue(job_id)

    def job_record(self, job_id: int) -> dict[str, str]:
        return self.fallback.job_record(job_id)

    def batch_script(self, job_id: int) -> str:
        return self.fallback.batch_script(job_id)

    def cancel(self, job_id: int, signal: Optional[str] = None, batch_only: bool = False) -> None:
        self.fallback.cancel(job_id, signal, batch_only)
