"""`exaserve submit --site FILE [--nodes N] [--time T] [--option KEY=VALUE ...] [--dry-run]`.

Renders sbatch/exaserve.sbatch from the site config and submits it with
`sbatch --parsable`; prints the job id and the job directory. --dry-run
prints the script instead. Exit codes: 0 submitted (or printed), 1 Slurm
refused, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from exaserve_hpc.config.schema import ConfigError, load_site, resolve_site
from exaserve_hpc.batch.slurm.backend import slurm_client
from exaserve_hpc.batch.slurm.client import SlurmError
from exaserve_hpc.batch.slurm.sbatch import SBATCH_OPTIONS, SbatchOptionError, options_from_site, render_sbatch
from exaserve_hpc.units import parse_duration, parse_size


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", help="site name or YAML path; default $EXASERVE_SITE or local")
    parser.add_argument("--nodes", type=int, help="nodes to ask for (default: cluster.nodes)")
    parser.add_argument("--time", help="time limit, e.g. 30m, 2h (default: cluster.time_limit)")
    parser.add_argument("--job-root", help="where job directories go (default: RUN_DIR/jobs; must be shared)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help=f"any sbatch template option: {', '.join(SBATCH_OPTIONS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the rendered script, submit nothing")


def _parse_option(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise SbatchOptionError(f"--option {text!r}: expected KEY=VALUE")
    default = SBATCH_OPTIONS.get(key)
    if isinstance(default, (list, tuple)):
        return key, [v for v in value.split(",") if v]
    if isinstance(default, bool):
        if value.lower() not in {"true", "false", "yes", "no", "1", "0"}:
            raise SbatchOptionError(f"--option {text!r}: {key} takes true or false")
        return key, value.lower() in {"true", "yes", "1"}
    if key == "mem":
        return key, value if value == "all" else None if value in {"", "none"} else parse_size(value)
    if key == "cpus_per_task":
        return key, int(value) if value not in {"", "none"} else None
    if isinstance(default, int) or key in {"nodes", "time_limit"}:
        return key, parse_duration(value) if key == "time_limit" else int(value)
    return key, value


def build_script(args: argparse.Namespace) -> tuple[str, dict]:
    site_file = resolve_site(args.site)
    site = load_site(site_file)
    time_limit = parse_duration(args.time) if args.time else None
    options = options_from_site(site, site_file, nodes=args.nodes, time_limit=time_limit,
                                job_root=Path(args.job_root).expanduser().resolve() if args.job_root else None)
    options.update(_parse_option(o) for o in args.option)
    return render_sbatch(**options), options


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        script, options = build_script(args)
    except (SbatchOptionError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    problem = load_site(resolve_site(args.site)).mpi_problem()
    if problem is not None:  # refused before Slurm queues a job that cannot start
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # The script copy is 0600 from its first byte, and sbatch records this umask (SLURM_UMASK) for the
    # job's output files and its shell: they name the site's paths and the job's logs, the user's alone.
    os.umask(0o077)
    job_root = Path(options["job_root"])
    job_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = job_root / f"{options['job_name']}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sbatch"
    path.write_text(script)
    try:
        job_id = slurm_client().submit(path)
    except SlurmError as exc:
        print(f"error: Slurm refused the job: {exc}\n  script: {path}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}: {options['nodes']} node(s); job dir {job_root / str(job_id)}; "
          f"log {job_root / f'exaserve-{job_id}.out'}")
    return 0
