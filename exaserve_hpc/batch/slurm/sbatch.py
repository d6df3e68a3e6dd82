"""Render sbatch/exaserve.sbatch: one pure function whose keyword arguments are the schema.

    render_sbatch(site_file="/p/site.yaml", job_root="/p/run/jobs", nodes=4, time_limit=1800,
                  partition="debug", gpus_per_node=4, modules=["openmpi"])

Unknown keywords raise SbatchOptionError listing every valid one with its
default. `options_from_site(site)` gives the keywords a site config implies;
companion (replacement) jobs are rendered by the same function from the same
options, with their own name, node count, exclusions and the main job's
remaining time (batch/slurm/companion_jobs.py).

The job asks for what the fleet uses on each node: its GPUs (--gpus-per-node,
which srun passes on to the step so Slurm sets CUDA_VISIBLE_DEVICES), whole
nodes (--exclusive), memory (--mem; 0 = all of it: L2 in /dev/shm counts
against the job under cgroup confinement) and CPUs (--cpus-per-task; without
it the one task gets every CPU the job holds on its node).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.resources import data_path

TEMPLATE = data_path("sbatch/exaserve.sbatch")  # the checkout's, or the installed package's copy

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
    "gpus_per_node": 0,         # --gpus-per-node for the job and its step; 0: no GPUs asked for
    "exclusive": True,          # --exclusive: whole nodes
    "mem": "all",               # per node: "all" (--mem=0), bytes, or None (the partition's default)
    "cpus_per_task": None,      # --cpus-per-task; None: every CPU the job holds on the node
    "mpi": "pmix",              # srun --mpi: pmix (rank 0 is MPI rank 0), pmi2, or none (job-directory bootstrap)
    "stop_signal": "USR1",      # sent to every rank stop_before_s seconds before the time limit
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


MPI_TYPES = ("pmix", "pmi2", "none")


def slurm_memory(value: Any) -> str:
    """--mem's value: "all" -> "0" (the whole node); bytes -> whole GiB ("512G") or MiB rounded up."""
    if value == "all":
        return "0"
    if isinstance(value, bool) or not isinstance(value, int) or value < 2**20:
        raise SbatchOptionError(f'mem must be "all", None or a number of bytes >= 1 MiB, found {value!r}')
    return f"{value // 2**30}G" if value % 2**30 == 0 else f"{-(-value // 2**20)}M"


def _check(o: dict[str, Any]) -> None:
    for required in ("site_file", "job_root"):
        if not o[required]:
            raise SbatchOptionError(f"{required} is required; valid: {valid_options()}")
    for key, low in (("nodes", 1), ("gpus_per_node", 0)):
        if isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < low:
            raise SbatchOptionError(f"{key} must be a whole number >= {low}, found {o[key]!r}")
    if o["cpus_per_task"] is not None and (isinstance(o["cpus_per_task"], bool)
                                           or not isinstance(o["cpus_per_task"], int) or o["cpus_per_task"] < 1):
        raise SbatchOptionError(f"cpus_per_task must be a whole number >= 1 or None, found {o['cpus_per_task']!r}")
    if o["mpi"] not in MPI_TYPES:
        raise SbatchOptionError(f"mpi must be one of {', '.join(MPI_TYPES)}, found {o['mpi']!r}")
    if not isinstance(o["exclusive"], bool):
        raise SbatchOptionError(f"exclusive must be true or false, found {o['exclusive']!r}")


def sbatch_directives(o: dict[str, Any]) -> list[str]:
    """The #SBATCH options, in a fixed order (the golden file pins it)."""
    directives = [f"--job-name={o['job_name']}", f"--nodes={o['nodes']}", "--ntasks-per-node=1"]
    if o["cpus_per_task"]:
        directives.append(f"--cpus-per-task={o['cpus_per_task']}")
    if o["gpus_per_node"]:
        directives.append(f"--gpus-per-node={o['gpus_per_node']}")
    if o["mem"] is not None:
        directives.append(f"--mem={slurm_memory(o['mem'])}")
    if o["exclusive"]:
        directives.append("--exclusive")
    directives += [
        "--no-kill",
        "--requeue",
        # No "B:": the signal goes to every rank of the step, never to this shell alone.
        f"--signal={o['stop_signal']}@{int(o['stop_before_s'])}",
        f"--output={o['job_root']}/exaserve-%j.out",
        "--open-mode=append",
    ]
    if o["time_limit"]:
        directives.append(f"--time={slurm_duration(o['time_limit'])}")
    for key in ("partition", "account", "qos", "exclude"):
        if o[key]:
            directives.append(f"--{key}={o[key]}")
    return directives + list(o["extra_directives"])


def srun_command(o: dict[str, Any]) -> str:
    """The step: one task per node, surviving a lost node, with the job's GPUs and the node's CPUs.
    srun is given --cpus-per-task itself (Slurm 22.05's srun no longer reads SLURM_CPUS_PER_TASK)."""
    cpus = o["cpus_per_task"] or '"${SLURM_CPUS_ON_NODE}"'
    parts = ["srun --no-kill --kill-on-bad-exit=0", f"--mpi={o['mpi']}", "--cpu-bind=none",
             f"--cpus-per-task={cpus}"]
    if o["gpus_per_node"]:
        parts.append(f"--gpus-per-node={o['gpus_per_node']}")
    return (" ".join(parts) + ' \\\n     --nodes="${SLURM_JOB_NUM_NODES}" --ntasks="${SLURM_JOB_NUM_NODES}" '
            "--ntasks-per-node=1")


def render_sbatch(**options: Any) -> str:
    unknown = sorted(set(options) - set(SBATCH_OPTIONS))
    if unknown:
        raise SbatchOptionError(f"unknown sbatch option(s) {', '.join(unknown)}; valid: {valid_options()}")
    o = {**SBATCH_OPTIONS, **options}
    _check(o)
    job_root = str(o["job_root"])
    directives = sbatch_directives(o)
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
        "@@SRUN@@": srun_command(o),
        "@@LAUNCHER@@": launcher,
        "@@STOP_SIGNAL@@": str(o["stop_signal"]),
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
        "gpus_per_node": cluster.gpus_per_node,
        "exclusive": cluster.exclusive,
        "mem": cluster.mem,
        "cpus_per_task": cluster.cpus_per_task,
        "mpi": cluster.mpi,
    }
