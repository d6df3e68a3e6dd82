"""Render sbatch/exaserve.sbatch: one pure function whose keyword arguments are the schema.

    render_sbatch(site_file="/p/site.yaml", job_root="/p/run/jobs", nodes=4, time_limit=1800,
                  partition="debug", modules=["openmpi"])

Unknown keywords raise SbatchOptionError listing every valid one with its
default. `options_from_site(site)` gives the keywords a site config implies.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from ..config import SiteConfig

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "exaserve.sbatch"

# The schema: every option render_sbatch takes, with its default (None: required or left out).
SBATCH_OPTIONS: dict[str, Any] = {
    "site_file": None,          # required: absolute path of the site YAML every rank reads
    "job_root": None,           # required: the job directory is JOB_ROOT/$SLURM_JOB_ID (shared storage)
    "job_name": "exaserve",
    "nodes": 1,
    "time_limit": None,         # seconds; None: the partition's limit
    "partition": None,
    "account": None,
    "qos": None,
    "exclude": None,            # hostlist of nodes to avoid
    "modules": (),              # environment modules loaded before anything runs
    "stop_signal": "USR1",      # sent to the batch shell stop_before_s seconds before the time limit
    "stop_before_s": 120,
    "launcher": None,           # per-rank command; None: this Python's `-m exaserve_hpc.launcher`
    "extra_directives": (),     # further "#SBATCH" options, e.g. ["--exclusive"]
}


class SbatchOptionError(ValueError):
    pass



def default_launcher() -> str:
    """The per-rank command: this install's Python running `exaserve launch`'s module (no PATH needed)."""
    return f"{shlex.quote(sys.executable)} -m exaserve_hpc.launcher"

def valid_options() -> str:
    return ", ".join(f"{k} (default {v!r})" for k, v in SBATCH_OPTIONS.items())


def slurm_duration(seconds: float) -> str:
    """1800 -> "30:00"; 90000 -> "1-01:00:00" (Slurm rounds up to whole minutes)."""
    minutes = max(1, -(-int(seconds) // 60))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:00"
    return f"{hours}:{minutes:02d}:00" if hours else f"{minutes}:00"


def render_sbatch(**options: Any) -> str:
    unknown = sorted(set(options) - set(SBATCH_OPTIONS))
    if unknown:
        raise SbatchOptionError(f"unknown sbatch option(s) {', '.join(unknown)}; valid: {valid_options()}")
    o = {**SBATCH_OPTIONS, **options}
    for required in ("site_file", "job_root"):
        if not o[required]:
            raise SbatchOptionError(f"{required} is required; valid: {valid_options()}")
    if not isinstance(o["nodes"], int) or o["nodes"] < 1:
        raise SbatchOptionError(f"nodes must be a whole number >= 1, found {o['nodes']!r}")
    job_root = str(o["job_root"])
    directives = [
        f"--job-name={o['job_name']}",
        f"--nodes={o['nodes']}",
        "--ntasks-per-node=1",
        "--no-kill",
        "--requeue",
        f"--signal=B:{o['stop_signal']}@{int(o['stop_before_s'])}",
        f"--output={job_root}/exaserve-%j.out",
        "--open-mode=append",
    ]
    if o["time_limit"]:
        directives.append(f"--time={slurm_duration(o['time_limit'])}")
    for key in ("partition", "account", "qos", "exclude"):
        if o[key]:
            directives.append(f"--{key}={o[key]}")
    directives += list(o["extra_directives"])
    modules = list(o["modules"])
    module_lines = ""
    if modules:
        module_lines = ("# Environment modules named by the site config (cluster.modules).\n"
                        "type module >/dev/null 2>&1 || source /etc/profile.d/lmod.sh 2>/dev/null "
                        "|| source /usr/share/lmod/lmod/init/bash\n"
                        f"module load {' '.join(shlex.quote(m) for m in modules)} || exit 1")
    launcher = o["launcher"] or default_launcher()
    text = TEMPLATE.read_text()
    replacements = {
        "@@DIRECTIVES@@": "\n".join(f"#SBATCH {d}" for d in directives),
        "@@MODULES@@": module_lines,
        "@@SITE_FILE@@": shlex.quote(str(o["site_file"])),
        "@@JOB_ROOT@@": shlex.quote(job_root),
        "@@LAUNCHER@@": launcher,
        "@@STOP_BEFORE_S@@": str(int(o["stop_before_s"])),
    }
    for marker, value in replacements.items():
        text = text.replace(marker, value)
    return text


def options_from_site(site: SiteConfig, site_file: Path, nodes: Optional[int] = None,
                      time_limit: Optional[float] = None, job_root: Optional[Path] = None) -> dict[str, Any]:
    cluster = site.cluster
    return {
        "site_file": str(Path(site_file).resolve()),
        "job_root": str(job_root or site.run_path / "jobs"),
        "job_name": f"exaserve-{site.site}",
        "nodes": nodes or cluster.nodes,
        "time_limit": time_limit if time_limit is not None else cluster.time_limit,
        "partition": cluster.partition,
        "account": cluster.account,
        "qos": cluster.qos,
        "modules": list(cluster.modules),
    }
