"""The one seam to Slurm: submit, query, update, requeue and cancel jobs; read node states.

    client = slurm_client()          # backend.py: pyslurm when it imports and matches the running Slurm, else the CLI
    job_id = client.submit(Path("job.sbatch"), ["--nodes=4"])
    client.job(job_id).state         # JobState.RUNNING
    client.nodes()                   # [NodeInfo(name="n1", state=NodeState.IDLE, ...)]
    client.requeue(job_id)          # back to the queue (batch/slurm/job.py decides how to exclude nodes)

`SlurmClient` is the interface; `CliSlurmClient` runs sbatch/squeue/sinfo/
scontrol/scancel through a replaceable `runner` (unit tests pass a fake one)
and hands their stdout to the pure parsers in `parse.py`. A failed command
raises SlurmCommandError carrying the command, exit code and stderr.
"""

from __future__ import annotations

import abc
import logging
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from exaserve_hpc.config.hostlist import compress_hostlist
from exaserve_hpc.batch.slurm.parse import (
    JobInfo, NodeInfo, job_from_scontrol, node_from_scontrol, parse_sbatch_parsable, parse_scontrol_show,
    parse_sinfo_json, parse_squeue_json,
)

log = logging.getLogger("exaserve.slurm")


class SlurmError(Exception):
    """Slurm could not do what we asked."""


class SlurmCommandError(SlurmError):
    def __init__(self, command: Sequence[str], returncode: int, stderr: str):
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"`{' '.join(self.command)}` exited with {returncode}: {self.stderr or '(no stderr)'}")


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], CommandResult]


def run_command(command: Sequence[str], timeout: float) -> CommandResult:
    """The real runner: no shell, captured output, a timeout reported like a failure."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        return CommandResult(127, "", f"{command[0]}: command not found ({exc.strerror}); is Slurm installed "
                                      f"and on PATH (module load slurm)?")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"no answer within {timeout:.0f}s (is slurmctld up? scontrol ping)")
    return CommandResult(done.returncode, done.stdout, done.stderr)


class SlurmClient(abc.ABC):
    """What the rest of exaserve may ask of Slurm. States come back as our enums."""

    backend: str = "abstract"

    @abc.abstractmethod
    def submit(self, script: Path, options: Sequence[str] = ()) -> int:
        """Submit a batch script; extra sbatch options (e.g. "--exclude=n3") go before it. Returns the job id."""

    @abc.abstractmethod
    def jobs(self, job_ids: Sequence[int] = (), user: Optional[str] = None) -> list[JobInfo]:
        """Jobs slurmctld still knows (recently finished ones included, for MinJobAge)."""

    def job(self, job_id: int) -> JobInfo:
        found = [j for j in self.jobs([job_id]) if j.job_id == job_id]
        if not found:
            raise SlurmError(f"job {job_id} is unknown to slurmctld (finished more than MinJobAge ago, "
                             f"or never existed)")
        return found[0]

    @abc.abstractmethod
    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        ...

    @abc.abstractmethod
    def update_job(self, job_id: int, **fields: str) -> None:
        """scontrol update jobid=ID Key=Value ... (e.g. ExcNodeList="n3", TimeLimit="30")."""

    @abc.abstractmethod
    def requeue(self, job_id: int) -> None:
        """Put a batch job back in the queue (ending every process of its current run, the caller's too).

        Slurm holds a requeued job for about two minutes (BeginTime) before it may start again. Nodes
        to avoid next time cannot be set from inside the job (batch/slurm/job.py: a successor job)."""

    def job_record(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as Key -> Value (EndTime, Command, ...)."""
        raise SlurmError(f"the {self.backend} backend cannot show job {job_id}'s record")

    def batch_script(self, job_id: int) -> str:
        """The job's batch script as submitted (`scontrol write batch_script JOB -`)."""
        raise SlurmError(f"the {self.backend} backend cannot read job {job_id}'s batch script")

    @abc.abstractmethod
    def cancel(self, job_id: int, signal: Optional[str] = None, batch_only: bool = False) -> None:
        ...


class CliSlurmClient(SlurmClient):
    """Slurm's commands with --json/--parsable/-o output; the tested default."""

    backend = "cli"

    def __init__(self, runner: Runner = run_command, timeout: float = 30.0):
        self.runner = runner
        self.timeout = timeout

    def _run(self, *command: str) -> str:
        result = self.runner(command, self.timeout)
        if result.returncode != 0:
            raise SlurmCommandError(command, result.returncode, result.stderr)
        return result.stdout

    def submit(self, script: Path, options: Sequence[str] = ()) -> int:
        return parse_sbatch_parsable(self._run("sbatch", "--parsable", *options, str(script)))

    def jobs(self, job_ids: Sequence[int] = (), user: Optional[str] = None) -> list[JobInfo]:
        # Name the user and the jobs, so slurmctld answers for them only (22.05's --json lists every job
        # whatever the filters: we filter again). --jobs=N exits 1 once N has left slurmctld's memory:
        # then ask for the user's jobs only.
        mine = [f"--user={user}"] if user else ["--me"]
        command = ["squeue", "--json", *mine]
        try:
            text = self._run(*command, *([f"--jobs={','.join(map(str, job_ids))}"] if job_ids else []))
        except SlurmCommandError as exc:
            if not job_ids or "Invalid job id" not in exc.stderr:
                raise
            text = self._run(*command)
        jobs = parse_squeue_json(text)
        return [j for j in jobs if not job_ids or j.job_id in set(job_ids)]

    def job_record(self, job_id: int) -> dict[str, str]:
        try:
            return parse_scontrol_show(self._run("scontrol", "show", "job", str(job_id), "-o"))[0]
        except SlurmCommandError as exc:
            if "Invalid job id" in exc.stderr:
                raise SlurmError(f"job {job_id} is unknown to slurmctld (finished more than MinJobAge ago, "
                                 f"or never existed)") from exc
            raise

    def job(self, job_id: int) -> JobInfo:
        return job_from_scontrol(self.job_record(job_id))

    def batch_script(self, job_id: int) -> str:
        return self._run("scontrol", "write", "batch_script", str(job_id), "-")

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        command = ["sinfo", "--json"] + ([f"--nodes={compress_hostlist(list(names))}"] if names else [])
        nodes = parse_sinfo_json(self._run(*command))
        # sinfo lists a node once per partition it is in; keep one.
        unique = {n.name: n for n in nodes}
        return [unique[n] for n in unique if not names or n in names]

    def node(self, name: str) -> NodeInfo:
        return node_from_scontrol(parse_scontrol_show(self._run("scontrol", "show", "node", name, "-o"))[0])

    def update_job(self, job_id: int, **fields: str) -> None:
        if not fields:
            raise ValueError("update_job needs at least one Key=Value")
        self._run("scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items()))

    def requeue(self, job_id: int) -> None:
        self._run("scontrol", "requeue", str(job_id))

    def cancel(self, job_id: int, signal: Optional[str] = None, batch_only: bool = False) -> None:
        command = ["scancel"] + ([f"--signal={signal}"] if signal else []) + (["--batch"] if batch_only else [])
        self._run(*command, str(job_id))

    def version(self) -> str:
        """"22.05.8" from `sinfo --version` ("slurm-wlm 22.05.8" on Debian, "slurm 23.11.1" upstream)."""
        text = self._run("sinfo", "--version")
        match = re.search(r"(\d+\.\d+\.\d+)", text)
        if not match:
            raise SlurmError(f"cannot read a Slurm version from {text!r}")
        return match.group(1)


def _major_minor(version: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", version)
    return (int(parts[0]), int(parts[1])) if len(parts) >= 2 else (0, 0)


def pyslurm_matches(pyslurm_version: str, slurm_version: str) -> bool:
    """pyslurm X.Y.* is built against Slurm X.Y and only talks to it."""
    return _major_minor(pyslurm_version) == _major_minor(slurm_version) != (0, 0)
