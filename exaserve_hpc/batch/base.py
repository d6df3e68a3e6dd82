"""What `exaserve launch` asks of the batch system that started it; one subclass per batch system.

Call protocol (rank 0, launcher/): rank_info() once at start; end_time() every few seconds at most
(the limit may change while the job runs: `scontrol update TimeLimit=`); requeue() once, after the
controller's state is written; request_nodes() / requested_nodes() / release_requests() for
replacement nodes. Every method that asks the batch system may raise JobEnvError.
"""

from __future__ import annotations

import abc
import enum
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from exaserve_hpc.jobdir import BootstrapError

# ---------------------------------------------------------------- which rank this process is

MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


class Role(enum.Enum):
    CONTROLLER = "controller"  # rank 0: controller thread, router, gateway; also the agent of its own node
    AGENT = "agent"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    size: int
    node: str          # Slurm node name (SLURMD_NODENAME), else the hostname
    job_id: str        # SLURM_JOB_ID, "local" outside Slurm
    restart: int       # SLURM_RESTART_COUNT: 0 first run, +1 per requeue
    source: str        # "mpi", "slurm" or "local"


def role_for(rank: int) -> Role:
    return Role.CONTROLLER if rank == 0 else Role.AGENT


def under_mpi(env: Mapping[str, str]) -> bool:
    """Launched by mpirun/mpiexec? Only then do we import mpi4py (its import initialises MPI)."""
    return any(v in env for v in MPI_RANK_VARIABLES)


def _mpi_comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


# Set in a successor job's script: the job directory whose checkpoint the successor restores.
RESUME_VARIABLE = "EXASERVE_RESUME_DIR"


class JobEnvError(Exception):
    """The batch system could not do what was asked; the message says what and why."""


@dataclass(frozen=True)
class RequeueOutcome:
    how: str                 # "requeued" (same job, back in the queue) or "successor" (a new job follows)
    job_id: str              # the job that will run next
    detail: str              # for logs
    stop_now: bool = False   # True: this run must end by itself (a successor waits for it to end)


class JobEnvironment(abc.ABC):
    name = "abstract"

    def __init__(self, env: Optional[Mapping[str, str]] = None):
        self.env = dict(os.environ if env is None else env)

    @classmethod
    @abc.abstractmethod
    def detects(cls, env: Mapping[str, str]) -> bool:
        """Is this process a task of a job of this batch system?"""

    @abc.abstractmethod
    def task(self) -> tuple[int, int, str, str, int]:
        """(rank, size, node name, job id, restart count) as the batch system states them."""

    def rank_info(self, comm: Any = None) -> RankInfo:
        """MPI's rank and size when launched by MPI (mpi4py), else the batch system's."""
        rank, size, node, job_id, restart = self.task()
        if comm is None and under_mpi(self.env):
            try:
                comm = _mpi_comm()
            except ImportError as exc:
                found = ", ".join(v for v in MPI_RANK_VARIABLES if v in self.env)
                raise BootstrapError(f"launched by MPI ({found} is set) but mpi4py does not import: {exc}; "
                                     f"pip install mpi4py") from exc
        if comm is not None:
            return RankInfo(comm.Get_rank(), comm.Get_size(), node, job_id, restart, "mpi")
        return RankInfo(rank, size, node, job_id, restart, self.name)

    @property
    def can_requeue(self) -> bool:
        return False

    def end_time(self) -> Optional[float]:
        """Epoch seconds at which the batch system ends the job; None: no limit, or not known."""
        return None

    def requeue(self, exclude: Sequence[str], job_dir: Path) -> RequeueOutcome:
        """Come back later (its checkpoint is in job_dir), never on the `exclude` nodes."""
        raise JobEnvError(f"{self.name}: not a batch job; nothing to requeue")

    def enable_node_requests(self, site: Any, site_file: Path, job_dir: Path) -> None:
        """Prepare request_nodes: the site config (and its file) the new nodes' agents run with."""

    def request_nodes(self, count: int, exclude: Sequence[str]) -> Optional[str]:
        """Ask for `count` more nodes whose agents join this job's controller; returns the request's id."""
        raise JobEnvError(f"{self.name}: cannot ask for more nodes outside a batch system")

    def requested_nodes(self) -> int:
        """Nodes asked for by request_nodes that are still on the way or running."""
        return 0

    def release_requests(self) -> None:
        """Cancel every request_nodes allocation (the controller they join is going away)."""

    def end_job(self, why: str) -> None:
        """End the whole job now (its nodes go back), from one of its own ranks."""
        raise JobEnvError(f"{self.name}: not a batch job; nothing to end ({why})")

    def batch_host_lost(self) -> bool:
        """Is the node running the job's batch script down? Such a job cannot end by itself when its ranks
        are done (Slurm waits for the script), so a rank must end it. False when it cannot tell."""
        return False

    def resume_dir(self) -> Optional[Path]:
        """A predecessor job's directory whose checkpoint this run restores (a successor job)."""
        value = self.env.get(RESUME_VARIABLE)
        return Path(value) if value else None

    @staticmethod
    def hostname() -> str:
        return socket.gethostname()
