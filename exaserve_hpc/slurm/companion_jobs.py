"""Replacement nodes for a running job: a companion Slurm job whose ranks join the controller as agents.

    script = render_companion(job_id="42", job_dir=..., site_file=..., nodes=1, exclude=["n3"], ...)
    client.submit(script_path)  -> companion job; each of its ranks runs `exaserve launch --join`,
                                   reads JOB_DIR/controller.json and the job's CURVE client key, and
                                   says hello to the running controller like any other node agent.

CompanionJobs is rank 0's bookkeeping: what was asked for, what is still on the way, and cancelling
every companion when the main job ends or is requeued (a companion outliving its controller would
hold nodes for nothing).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .client import SlurmClient, SlurmError
from .hostlist import compress_hostlist
from .sbatch import default_launcher, slurm_duration

log = logging.getLogger("exaserve.replacement")


def companion_name(job_id: str) -> str:
    return f"exaserve-replace-{job_id}"


def render_companion(job_id: str, job_dir: Path, site_file: str, nodes: int, exclude: Sequence[str] = (),
                     time_limit: Optional[float] = None, launcher: Optional[str] = None,
                     partition: Optional[str] = None, account: Optional[str] = None) -> str:
    launcher = launcher or default_launcher()
    directives = [f"--job-name={companion_name(job_id)}", f"--nodes={nodes}", "--ntasks-per-node=1", "--no-kill",
                  f"--output={Path(job_dir).parent}/{companion_name(job_id)}-%j.out", "--open-mode=append"]
    if exclude:
        directives.append(f"--exclude={compress_hostlist(list(exclude))}")
    if time_limit:
        directives.append(f"--time={slurm_duration(time_limit)}")
    if partition:
        directives.append(f"--partition={partition}")
    if account:
        directives.append(f"--account={account}")
    lines = ["#!/bin/bash", "# exaserve-hpc: replacement nodes for job " + job_id + " (agents join its controller)",
             *(f"#SBATCH {d}" for d in directives), "",
             f"export EXASERVE_JOB_DIR={shlex.quote(str(job_dir))}",
             f"echo \"exaserve companion ${{SLURM_JOB_ID}} of job {job_id} on ${{SLURM_JOB_NODELIST}}\"",
             "exec srun --no-kill --kill-on-bad-exit=0 --mpi=none --ntasks-per-node=1 "
             f"--nodes=\"${{SLURM_JOB_NUM_NODES}}\" --ntasks=\"${{SLURM_JOB_NUM_NODES}}\" "
             f"{launcher} --join --site {shlex.quote(site_file)} --job-dir {shlex.quote(str(job_dir))}", ""]
    return "\n".join(lines)


@dataclass
class CompanionJobs:
    client: SlurmClient
    job_id: str
    job_dir: Path
    site_file: str
    launcher: Optional[str] = None
    time_limit: Optional[float] = None
    submitted: dict[int, int] = field(default_factory=dict)  # companion job id -> nodes asked for

    def submit(self, nodes: int, exclude: Sequence[str]) -> Optional[int]:
        script = Path(self.job_dir) / f"replace-{len(self.submitted) + 1}.sbatch"
        script.write_text(render_companion(self.job_id, self.job_dir, self.site_file, nodes, exclude,
                                           self.time_limit, self.launcher))
        try:
            companion = self.client.submit(script)
        except SlurmError as exc:
            log.error("replacement job for %d node(s) not submitted: %s", nodes, exc)
            return None
        self.submitted[companion] = nodes
        return companion

    def asked(self) -> int:
        """Nodes asked for in companion jobs that have not ended."""
        if not self.submitted:
            return 0
        try:
            live = {j.job_id for j in self.client.jobs(list(self.submitted)) if not j.state.terminal}
        except SlurmError as exc:
            log.warning("cannot list companion jobs: %s", exc)
            return sum(self.submitted.values())
        return sum(n for j, n in self.submitted.items() if j in live)

    def cancel_all(self) -> None:
        for companion in list(self.submitted):
            try:
                self.client.cancel(companion)
            except SlurmError as exc:
                log.warning("cannot cancel companion job %d: %s", companion, exc)
