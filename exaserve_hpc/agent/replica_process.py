"""One replica as the agent sees it: its lifecycle, what it holds, and its process once spawned.

The replica process talks back on a pipe, one line per event:
    "<state> <seconds> <detail>"     a lifecycle step (seconds: the replica's own measure, informational)
    "progress <done> <total>"        bytes of weights copied into L1 so far
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Union

from exaserve_hpc.agent.gpu_binding import ReplicaBinding
from exaserve_hpc.agent.memory_pool import Reservation
from exaserve_hpc.engine.registry import ENGINES
from exaserve_hpc.engine.registry import RESERVED_ENV as RESERVED_BYTES_ENV  # the engine's memory bound per device
from exaserve_hpc.protocol import ReplicaStatus, StartReplica, encode
from exaserve_hpc.agent.lifecycle import Lifecycle, ReplicaState


@dataclass
class ReplicaSlot:
    spec: StartReplica
    lifecycle: Lifecycle
    started_at: float = field(default_factory=time.time)
    process: Optional[subprocess.Popen] = None
    status_fd: int = -1
    detail: str = ""
    exit_code: Optional[int] = None
    stop_deadline: float = 0.0
    reservation: Optional[Reservation] = None
    binding: Optional[ReplicaBinding] = None  # its devices, environment and CPUs (gpu_binding.py)
    l2_key: Optional[str] = None  # the L2 entry it waits for or pins
    load_source: str = ""  # "l2" | "l3" | ""
    l3_done: int = 0
    l3_total: int = 0
    l1_done: int = 0
    l1_total: int = 0
    released: bool = False
    partial: bytes = b""

    @property
    def state(self) -> ReplicaState:
        return self.lifecycle.state

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def needs_weights(self) -> bool:
        engine = ENGINES.get(self.spec.settings.engine)  # an unknown engine fails in its replica
        return engine is not None and engine.needs_weights

    @property
    def finished(self) -> bool:
        """Terminal and no process left running."""
        return self.state.terminal and (self.process is None or self.exit_code is not None)

    def load_progress(self) -> float:
        total = self.l3_total + self.l1_total
        if self.state not in (ReplicaState.PENDING, ReplicaState.RESERVING, ReplicaState.LOADING):
            return 1.0 if self.needs_weights else 0.0
        return (self.l3_done + self.l1_done) / total if total else 0.0

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(replica_id=self.replica_id, model=self.spec.model, state=self.state.value,
                             pid=self.process.pid if self.process else 0, started_at=self.started_at,
                             exit_code=self.exit_code, detail=self.detail,
                             load_progress=round(self.load_progress(), 4),
                             load_bytes_done=self.l3_done + self.l1_done,
                             load_bytes_total=self.l3_total + self.l1_total, load_source=self.load_source,
                             devices=list(self.binding.devices) if self.binding else [])


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def replica_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The replica's environment: one BLAS thread each unless the operator chose otherwise, plus
    what the agent adds (`extra`: under `exaserve launch`, where the job's CURVE keys are).

    Several replicas share a node's cores; OpenBLAS threads that spin waiting
    for work make every replica's steps many times slower under contention.
    """
    env = dict(os.environ)
    for name in BLAS_THREAD_VARIABLES:
        env.setdefault(name, "1")
    return {**env, **(extra or {})}


def replica_threads(env: Optional[Mapping[str, str]] = None) -> int:
    """Compute threads a replica runs: its BLAS threads as replica_env sets them (1 unless the operator chose
    otherwise); the controller bounds CPU replicas per node by it (controller/cpu_bound.py)."""
    env = os.environ if env is None else env
    best = 1
    for name in BLAS_THREAD_VARIABLES:
        try:
            best = max(best, int(env.get(name) or 1))
        except ValueError:
            continue
    return best


def usable_cores() -> int:
    """Cores this process may run on (its affinity: a Slurm step's cpuset, taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


# The Slurm step's MPI wiring: what srun (--mpi=pmix|pmi2), mpirun and the PMI libraries put in a task's
# environment so that an MPI_Init there joins the step's job. A replica whose engine starts MPI workers of its
# own (TensorRT-LLM's MpiPoolSession for TP) must not see them, or those workers try to join the srun step.
MPI_WIRING_PREFIXES = ("PMIX_", "PMI_", "OMPI_", "PRTE_", "ORTE_", "HYDRA_", "I_MPI_", "SLURM_STEP_",
                       "SLURM_PMIX", "SLURM_PMI", "SLURM_SRUN_COMM_", "SLURM_CPU_BIND")
MPI_WIRING_NAMES = frozenset({
    "SLURM_STEPID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_TASKS_PER_NODE", "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_MPI_TYPE",
    "SLURM_DISTRIBUTION"})


def without_mpi_wiring(env: dict[str, str]) -> dict[str, str]:
    """`env` less the step's PMIx/MPI/task variables (MPI_WIRING_*); the job's own (SLURM_JOB_*) stay."""
    return {k: v for k, v in env.items() if not k.startswith(MPI_WIRING_PREFIXES) and k not in MPI_WIRING_NAMES}



def spawn(slot: ReplicaSlot, node: str, weights_dir: str, source: str,
          extra_env: Optional[dict[str, str]] = None) -> None:
    """Start the replica process; it reports on a pipe the agent reads without blocking.

    Its environment: the agent's (replica_env), its binding's (CUDA_VISIBLE_DEVICES = exactly its reserved
    devices), its reservation per device, and, for engines that start MPI workers of their own
    (EngineSpec.isolate_mpi), none of the step's MPI wiring."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    command = [sys.executable, "-m", "exaserve_hpc.agent.replica_main", "--spec", encode(slot.spec).hex(),
               "--status-fd", str(write_fd), "--node", node]
    if weights_dir:
        command += ["--weights-dir", weights_dir, "--weights-source", source]
    binding = slot.binding
    env = {**(extra_env or {}), **(binding.env if binding else {})}
    if slot.reservation is not None:
        env[RESERVED_BYTES_ENV] = str(slot.reservation.bytes_per_device)
    env = replica_env(env)
    engine = ENGINES.get(slot.spec.settings.engine)
    if engine is not None and engine.isolate_mpi:
        env = without_mpi_wiring(env)
    try:
        with thread_affinity(binding.cpus if binding else None):
            slot.process = subprocess.Popen(command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, env=env)
    finally:
        os.close(write_fd)
    slot.status_fd = read_fd


@contextlib.contextmanager
def thread_affinity(cpus: Optional[frozenset[int]]) -> Iterator[None]:
    """Pin the calling thread to `cpus` while it starts a process, which inherits the mask from its first
    instruction; no preexec_fn, which is unsafe where other threads run (the rank-0 agent is a thread).
    sched_setaffinity(0) on Linux affects the calling thread only; the old mask is restored after."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


StatusLine = Union[tuple[ReplicaState, str], tuple[int, int], None]


def parse_status_line(line: str) -> StatusLine:
    """(state, detail) or (done, total) bytes of progress; None for a line we cannot read."""
    parts = line.split(" ", 2)
    try:
        if parts[0] == "progress":
            return int(parts[1]), int(parts[2])
        float(parts[1])
        return ReplicaState(parts[0]), (parts[2] if len(parts) > 2 else "")
    except (ValueError, IndexError):
        return None


class PipeProcesses:
    """Replica processes as the node agent runs them (agent/core.py's ReplicaProcesses): `spawn` above, and
    each process's state lines read from its status pipe without blocking."""

    def spawn(self, slot: ReplicaSlot, node: str, weights_dir: str, source: str, env: dict[str, str]) -> None:
        spawn(slot, node, weights_dir, source, env)

    def read_status(self, slot: ReplicaSlot) -> list[str]:
        if slot.status_fd < 0:
            return []
        try:
            data = os.read(slot.status_fd, 65536)
        except BlockingIOError:
            return []
        if not data:  # writer closed: the process is exiting
            self.close(slot)
            return []
        slot.partial += data
        *lines, slot.partial = slot.partial.split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def close(self, slot: ReplicaSlot) -> None:
        if slot.status_fd >= 0:
            os.close(slot.status_fd)
            slot.status_fd = -1
