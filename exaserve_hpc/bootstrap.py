"""Bootstrap of one Slurm job: who am I (role by rank), who else is there (inventories), where is
the controller and how do we trust it (address + CURVE keys in the job directory).

    rank = detect_rank()                  # MPI rank under mpirun (mpi4py), else the batch system's (batch/)
    role = role_for(rank.rank)            # Role.CONTROLLER for rank 0, Role.AGENT otherwise
    jobdir = JobDir(path)                 # files mode 0600, written atomically

Exchange (`exchange_inventories` / `publish_controller` / `wait_for_controller`):
  - under MPI: one comm.gather of inventories to rank 0 and one comm.bcast of the controller's
    address and public key, then nothing collective ever again;
  - otherwise: every rank writes inventory/rank-R.json, rank 0 waits (bounded) for them, then
    writes controller.json; agents poll for a controller.json of *this* run (job id + restart
    count), so a file left by the run before a requeue is never taken for the current one.
After bootstrap a lost rank hangs or aborts nobody: liveness is the controller's heartbeats.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from exaserve_hpc.agent.nvml_probe import host_memory, read_gpus
from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.batch import detect_job_environment
from exaserve_hpc.batch.base import RankInfo

log = logging.getLogger("exaserve.bootstrap")


def detect_rank(env: Optional[Mapping[str, str]] = None, comm: Any = None) -> RankInfo:
    """MPI rank under MPI; the batch system's (batch/: SLURM_PROCID/SLURM_NTASKS) in a job; 0 of 1 otherwise."""
    return detect_job_environment(env).rank_info(comm)


@dataclass
class NodeInventory:
    rank: int
    node: str
    hostname: str
    pid: int
    gpus: int = 0
    gpu_names: list[str] = field(default_factory=list)
    host_memory_total: int = 0

    @classmethod
    def probe(cls, rank: RankInfo) -> "NodeInventory":
        gpus, _ = read_gpus()
        return cls(rank=rank.rank, node=rank.node, hostname=socket.gethostname(), pid=os.getpid(), gpus=len(gpus),
                   gpu_names=[g.name for g in gpus], host_memory_total=host_memory()[0])


@dataclass
class ControllerInfo:
    """What rank 0 publishes: where to connect and which key proves it is our controller."""
    job_id: str
    restart: int
    endpoint: str                    # controller ROUTER, e.g. tcp://n1:40123
    gateway_url: str = ""
    server_public_key: str = ""      # Z85 CURVE key; "" when CURVE is off
    nodes: list[str] = field(default_factory=list)  # every rank's node, by rank
    published_at: float = 0.0
    error: str = ""  # rank 0 could not start the controller (the reason): every rank stops instead of waiting


# ---------------------------------------------------------------- exchange


def exchange_inventories(rank: RankInfo, jobdir: JobDir, inventory: NodeInventory, comm: Any = None,
                         timeout: float = 60.0, poll: float = 0.2) -> list[NodeInventory]:
    """Every rank hands in its inventory; rank 0 gets them all (others get []).

    Under MPI: one gather. Otherwise through files; rank 0 waits at most `timeout` and proceeds with
    the ranks that reported (a node that died during start-up must not stop the others).
    """
    if comm is not None:
        gathered = comm.gather(asdict(inventory), root=0)
        return [NodeInventory(**g) for g in gathered] if rank.rank == 0 else []
    tag = f"{rank.job_id}.{rank.restart}"
    jobdir.write_json(f"inventory/rank-{rank.rank}.json", {"run": tag, **asdict(inventory)})
    if rank.rank != 0:
        return []
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for r in range(rank.size):
            data = jobdir.read_json(f"inventory/rank-{r}.json")
            if data and data.pop("run", None) == tag:
                found[r] = NodeInventory(**data)
        if len(found) == rank.size or time.monotonic() > deadline:
            break
        time.sleep(poll)
    missing = sorted(set(range(rank.size)) - set(found))
    if missing:
        log.warning("bootstrap: no inventory from rank(s) %s after %.0fs; continuing without them", missing, timeout)
    return [found[r] for r in sorted(found)]


def publish_controller(rank: RankInfo, jobdir: JobDir, info: ControllerInfo, comm: Any = None) -> None:
    """Rank 0: controller.json (0600) for file readers, plus one bcast under MPI."""
    info.published_at = time.time()
    jobdir.write_json("controller.json", asdict(info))
    if comm is not None:
        comm.bcast(asdict(info), root=0)


def _started(rank: RankInfo, info: ControllerInfo) -> ControllerInfo:
    if info.error:
        raise BootstrapError(f"rank {rank.rank} on {rank.node}: rank 0 could not start the controller, so this "
                             f"rank stops too: {info.error}")
    return info


def wait_for_controller(rank: RankInfo, jobdir: JobDir, comm: Any = None, timeout: float = 300.0,
                        poll: float = 0.2) -> ControllerInfo:
    """Agents: the controller of *this* run (same job id and restart count)."""
    if comm is not None:
        return _started(rank, ControllerInfo(**comm.bcast(None, root=0)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = jobdir.read_json("controller.json")
        if data and data.get("job_id") == rank.job_id and data.get("restart") == rank.restart:
            return _started(rank, ControllerInfo(**data))
        time.sleep(poll)
    raise BootstrapError(f"rank {rank.rank} on {rank.node}: no controller.json for job {rank.job_id} restart "
                         f"{rank.restart} in {jobdir.path} after {timeout:.0f}s; is rank 0 running? "
                         f"(see the job's output file)")
