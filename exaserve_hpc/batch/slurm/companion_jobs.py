"""Replacement nodes for a running job: a companion Slurm job whose ranks join the controller as agents.

    companions = CompanionJobs(client, "42", job_dir, options_from_site(site, site_file), remaining)
    companions.submit(1, exclude=["n3"])   # the main job's batch script (every directive: partition,
                                           # account, QOS, GPUs, memory, modules) for 1 node, excluding
                                           # n3, limited to the main job's remaining time; its ranks run
                                           # `exaserve launch --join-job-dir JOB_DIR` and say hello to the
                                           # running controller like any other node agent
    companions.asked()                     # nodes asked for in companions that have not ended
    companions.cancel_all()                # the main job ends or is requeued

Slurm is asked about the companions by name (`squeue --me --jobs=...`), at most every poll_interval
seconds, however often the caller asks.
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from exaserve_hpc.batch.slurm.client import SlurmClient, SlurmError
from exaserve_hpc.config.hostlist import compress_hostlist, expand_hostlist
from exaserve_hpc.batch.slurm.sbatch import default_launcher, render_sbatch

log = logging.getLogger("exaserve.replacement")


def companion_name(job_id: str) -> str:
    return f"exaserve-replace-{job_id}"


def render_companion(job_id: str, job_dir: Path, options: dict[str, Any], nodes: int, exclude: Sequence[str] = (),
                     time_limit: Optional[float] = None, launcher: Optional[str] = None) -> str:
    """The main job's script (batch/slurm/sbatch.py, from the same site options) for `nodes` joining nodes."""
    excluded = sorted(set(exclude) | set(expand_hostlist(options["exclude"]) if options.get("exclude") else ()))
    o = {**options, "job_name": companion_name(job_id), "nodes": nodes, "job_root": str(Path(job_dir).parent),
         "launcher": f"{launcher or default_launcher()} --join-job-dir {shlex.quote(str(job_dir))}",
         "exclude": compress_hostlist(excluded) if excluded else None}
    if time_limit:
        o["time_limit"] = max(60.0, time_limit)
    return render_sbatch(**o)


@dataclass
class CompanionJobs:
    client: SlurmClient
    job_id: str
    job_dir: Path
    options: dict[str, Any]                                      # slurm.sbatch.options_from_site(...)
    remaining: Callable[[], Optional[float]] = lambda: None      # seconds the main job has left
    launcher: Optional[str] = None
    poll_interval: float = 5.0
    clock: Callable[[], float] = time.monotonic
    submitted: dict[int, int] = field(default_factory=dict)      # companion job id -> nodes asked for
    _asked: tuple[float, int] = (float("-inf"), 0)               # (when, nodes) of the last answer

    def submit(self, nodes: int, exclude: Sequence[str]) -> Optional[int]:
        script = Path(self.job_dir) / f"replace-{len(self.submitted) + 1}.sbatch"
        script.write_text(render_companion(self.job_id, self.job_dir, self.options, nodes, exclude,
                                           self.remaining(), self.launcher))
        try:
            companion = self.client.submit(script)
        except SlurmError as exc:
            log.error("replacement job for %d node(s) not submitted: %s", nodes, exc)
            return None
        self.submitted[companion] = nodes
        self._asked = (float("-inf"), 0)  # the next asked() asks Slurm
        return companion

    def asked(self) -> int:
        """Nodes asked for in companion jobs that have not ended."""
        if not self.submitted:
            return 0
        when, nodes = self._asked
        if self.clock() - when < self.poll_interval:
            return nodes
        try:
            live = {j.job_id for j in self.client.jobs(list(self.submitted)) if not j.state.terminal}
        except SlurmError as exc:
            log.warning("cannot list companion jobs: %s", exc)
            return sum(self.submitted.values())
        nodes = sum(n for j, n in self.submitted.items() if j in live)
        self._asked = (self.clock(), nodes)
        return nodes

    def cancel_all(self) -> None:
        for companion in list(self.submitted):
            try:
                self.client.cancel(companion)
            except SlurmError as exc:
                log.warning("cannot cancel companion job %d: %s", companion, exc)
