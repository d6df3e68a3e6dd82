"""Slurm as a job environment: ranks from srun's variables, the end time from slurmctld, requeue that
survives cgroup process tracking, and companion jobs for replacement nodes.

Requeue. `scontrol requeue` ends every process of the job, the caller included, and Slurm refuses
ExcNodeList on a job that is not pending ("Job is no longer pending execution"), so nothing can set
the exclusion after the requeue from inside the job (a shell left behind for it is killed with the
job's cgroup under proctrack/cgroup). Hence two ways:
  - nothing to exclude: `scontrol requeue JOB` (same job id and job directory; Slurm kills us);
  - nodes to exclude: a successor job, the same batch script (`scontrol write batch_script`) with
    `--exclude=LOST --dependency=afterany:JOB` and EXASERVE_RESUME_DIR naming this job's directory,
    whose rank 0 restores the checkpoint from it; this run then stops by itself, exit 0.

End time. SLURM_JOB_END_TIME is set at start only on newer Slurm and goes stale when the limit is
changed, so slurmctld is asked (`scontrol show job`), the variable only when slurmctld cannot answer.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from exaserve_hpc.config.hostlist import compress_hostlist, expand_hostlist
from exaserve_hpc.batch.base import RESUME_VARIABLE, JobEnvError, JobEnvironment, RequeueOutcome
from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError
from exaserve_hpc.batch.slurm.companion_jobs import CompanionJobs
from exaserve_hpc.batch.slurm.sbatch import options_from_site
from exaserve_hpc.batch.slurm.states import NodeState

log = logging.getLogger("exaserve.jobenv")


# ---------------------------------------------------------------- pure parsers (tests/slurm/samples)


def end_time_from_scontrol(record: Mapping[str, str]) -> Optional[float]:
    """EndTime of a `scontrol show job -o` record (slurmctld's local time) as epoch seconds."""
    if (record.get("TimeLimit") or "").upper() in ("UNLIMITED", "INFINITE"):
        return None
    text = record.get("EndTime") or ""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # "Unknown", "None", "N/A"
        return None


def end_time_from_squeue_json(text: str, job_id: int) -> Optional[float]:
    """end_time of one job in `squeue --json` (Slurm 22.05 lists every job whatever the filters)."""
    for job in json.loads(text).get("jobs", []):
        if int(_number(job.get("job_id")) or -1) != job_id:
            continue
        if job.get("time_limit") is None or _number(job.get("time_limit")) is None:
            return None  # unlimited: end_time is then a placeholder a year out
        end = _number(job.get("end_time"))
        return float(end) if end else None
    return None


def _number(value: Any) -> Optional[int]:
    """22.05 prints plain numbers; 23.02+ {"set": true, "infinite": false, "number": N}."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return None if value is None else int(value)


def script_exclusions(script: str) -> list[str]:
    """Nodes a batch script's own `#SBATCH --exclude=` / `-x` directives exclude."""
    nodes: list[str] = []
    for line in script.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "#SBATCH":
            if words[1].startswith("--exclude="):
                nodes += expand_hostlist(words[1].split("=", 1)[1])
            elif words[1] == "-x" and len(words) >= 3:
                nodes += expand_hostlist(words[2])
    return nodes


def successor_script(script: str, resume_dir: Path) -> str:
    """The batch script with EXASERVE_RESUME_DIR exported before its first command."""
    lines = script.splitlines()
    at = 0  # sbatch reads #SBATCH lines up to the first command, so the export goes there
    while at < len(lines) and (not lines[at].strip() or lines[at].lstrip().startswith("#")):
        at += 1
    export = f"export {RESUME_VARIABLE}={shlex.quote(str(resume_dir))}  # exaserve: restore from the predecessor's checkpoint"
    return "\n".join(lines[:at] + [export] + lines[at:]) + "\n"


# ---------------------------------------------------------------- the environment


class SlurmJobEnvironment(JobEnvironment):
    name = "slurm"

    def __init__(self, env: Optional[Mapping[str, str]] = None, client=None, companions=None):
        """client: a slurm.client.SlurmClient (default: the CLI one); companions: a
        slurm.companion_jobs.CompanionJobs for request_nodes (None: asking for nodes is refused)."""
        super().__init__(env)
        if client is None:
            client = CliSlurmClient()
        self.client = client
        self.companions = companions

    @classmethod
    def detects(cls, env: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in env

    def task(self) -> tuple[int, int, str, str, int]:
        e = self.env
        return (int(e.get("SLURM_PROCID", "0")), int(e.get("SLURM_NTASKS", "1")),
                e.get("SLURMD_NODENAME") or self.hostname(), e["SLURM_JOB_ID"],
                int(e.get("SLURM_RESTART_COUNT", "0") or 0))

    @property
    def job_number(self) -> int:
        try:
            return int(self.env["SLURM_JOB_ID"])
        except ValueError as exc:
            raise JobEnvError(f"SLURM_JOB_ID {self.env['SLURM_JOB_ID']!r} is not a job number") from exc

    @property
    def can_requeue(self) -> bool:
        return self.env.get("SLURM_JOB_ID", "").isdigit()

    def end_time(self) -> Optional[float]:
        try:
            return end_time_from_scontrol(self.client.job_record(self.job_number))
        except (SlurmError, IndexError, KeyError) as exc:
            fallback = self.env.get("SLURM_JOB_END_TIME")
            if fallback:
                log.warning("cannot read job %s's end time from slurmctld (%s); using SLURM_JOB_END_TIME",
                            self.job_number, exc)
                return float(fallback)
            raise JobEnvError(f"cannot read job {self.job_number}'s end time: {exc}") from exc

    def requeue(self, exclude: Sequence[str], job_dir: Path) -> RequeueOutcome:
        job = self.job_number
        try:
            if not exclude:
                self.client.requeue(job)  # ends this run; the same job comes back from the queue
                return RequeueOutcome("requeued", str(job), f"job {job} requeued")
            script = Path(job_dir) / "successor.sbatch"
            text = self.client.batch_script(job)
            script.write_text(successor_script(text, Path(job_dir)))
            # --exclude on the command line replaces the script's own: keep what it excluded too
            hosts = compress_hostlist(sorted(set(exclude) | set(script_exclusions(text))))
            successor = self.client.submit(script, [f"--dependency=afterany:{job}", f"--exclude={hosts}"])
        except SlurmError as exc:
            raise JobEnvError(f"requeue of job {job} failed: {exc}") from exc
        (Path(job_dir) / "successor.json").write_text(json.dumps({"job_id": successor, "after": job,
                                                                  "exclude": list(exclude)}))
        return RequeueOutcome("successor", str(successor),
                              f"successor job {successor} starts when job {job} ends, excluding {hosts}",
                              stop_now=True)

    def enable_node_requests(self, site: Any, site_file: Path, job_dir: Path) -> None:
        """Companion jobs rendered from the main job's own site options (every directive, modules)."""
        self.companions = CompanionJobs(self.client, str(self.job_number), Path(job_dir),
                                        options_from_site(site, Path(site_file), job_root=Path(job_dir).parent),
                                        self.seconds_left)

    def seconds_left(self) -> Optional[float]:
        try:
            end = self.end_time()
        except JobEnvError:
            return None
        return None if end is None else end - time.time()

    def request_nodes(self, count: int, exclude: Sequence[str]) -> Optional[str]:
        if self.companions is None:
            raise JobEnvError("replacement nodes are off (requeue.replace_lost_nodes / --replace-lost-nodes)")
        companion = self.companions.submit(count, exclude)
        return None if companion is None else str(companion)

    def requested_nodes(self) -> int:
        return 0 if self.companions is None else self.companions.asked()

    def release_requests(self) -> None:
        if self.companions is not None:
            self.companions.cancel_all()

    def end_job(self, why: str) -> None:
        """scancel this job: a successor waiting on it (afterany) starts, its nodes go back. This rank's own
        step is signalled too (TERM, then KILL after KillWait), so call it last."""
        log.warning("cancelling job %s: %s", self.job_number, why)
        try:
            self.client.cancel(self.job_number)
        except SlurmError as exc:
            raise JobEnvError(f"cannot cancel job {self.job_number}: {exc}") from exc

    def batch_host_lost(self) -> bool:
        try:
            host = self.client.job_record(self.job_number).get("BatchHost", "")
            return bool(host) and self.client.nodes([host])[0].state is NodeState.DOWN
        except (SlurmError, IndexError, KeyError, JobEnvError) as exc:
            log.warning("cannot tell whether job %s's batch host is up: %s", self.env.get("SLURM_JOB_ID"), exc)
            return False
