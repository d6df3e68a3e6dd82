"""Which Slurm client a process uses: pyslurm when it imports and matches the running Slurm, else the CLI.

    client = slurm_client()          # SlurmClient (client.py): jobs, nodes, submit, requeue, cancel
"""

from __future__ import annotations

import os
import shutil
import logging
from typing import Optional

from exaserve_hpc.batch.slurm.client import (CliSlurmClient, Runner, SlurmClient, SlurmError, pyslurm_matches,
                                       run_command)

try:  # pyslurm is optional (the [pyslurm] extra); its absence is an answer, not an error
    from exaserve_hpc.batch.slurm.pyslurm_backend import PyslurmClient, pyslurm_version
    PYSLURM_MISSING = ""
except ImportError as exc:
    PYSLURM_MISSING = str(exc)

log = logging.getLogger("exaserve.slurm")


def slurm_client(prefer: Optional[str] = None, runner: Runner = run_command) -> SlurmClient:
    """The CLI client, or the pyslurm one when pyslurm imports and matches the running Slurm.

    prefer / $EXASERVE_SLURM_BACKEND: "cli" forces the CLI; "pyslurm" requires pyslurm (SlurmError if it
    cannot be used, naming why).
    """
    prefer = prefer or os.environ.get("EXASERVE_SLURM_BACKEND", "auto")
    if prefer not in {"auto", "cli", "pyslurm"}:
        raise ValueError(f"Slurm backend {prefer!r}; allowed: auto, cli, pyslurm")
    cli = CliSlurmClient(runner)
    if prefer == "cli":
        return cli
    if PYSLURM_MISSING:
        why = f"pyslurm does not import ({PYSLURM_MISSING})"
    else:
        pv = pyslurm_version()
        sv = cli.version() if shutil.which("sinfo") or runner is not run_command else ""
        if pyslurm_matches(pv, sv):
            return PyslurmClient(fallback=cli)
        why = f"pyslurm {pv} does not match Slurm {sv or '(unknown)'}"
    if prefer == "pyslurm":
        raise SlurmError(f"the pyslurm backend was asked for but {why}; use the CLI backend "
                         f"(EXASERVE_SLURM_BACKEND=cli) or install the pyslurm release matching Slurm")
    log.debug("Slurm backend: cli (%s)", why)
    return cli
