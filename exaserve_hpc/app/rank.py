"""`exaserve launch`: one rank of a batch job (srun starts one per node).

    srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 python -m exaserve_hpc.launcher --site S --job-dir D

What rank k runs is decided here (`cmd_launch`): rank 0 builds the control plane (app/control_plane.py, the
same as `exaserve serve`): router, controller, gateway, and its own node's agent in a thread; ranks below
`router.count` also run router k and its gateway (app/router_rank.py); under HA ranks below `ha.candidates`
are controller candidates (app/ha_rank.py); every other rank runs its node's agent (app/agents.py). The
bootstrap (bootstrap.py) exchanges inventories and publishes the controller's address and CURVE key in the
job directory; after it, ranks only talk ZeroMQ, so a lost rank stops nobody.
Everything about the batch system (rank, job id, end time, requeue, more nodes) comes from batch/.

Stopping: SIGTERM (scancel, preemption) and SIGUSR1 (Slurm's warning before the time limit) are a
graceful stop on every rank: rank 0 writes the checkpoint, drains and stops; each agent stops its
replicas and removes its L2 files; every rank exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from exaserve_hpc.agent.gpu_binding import GpuGrantError
from exaserve_hpc.agent.node_agent import EXIT_BAD_GRANT, EXIT_CONTROLLER_LOST, L2_RUN_VARIABLE
from exaserve_hpc.app.agents import build_agent, stop_gracefully_on_signals
from exaserve_hpc.app.control_plane import ControlPlane, ControlPlaneError, PlaneSettings
from exaserve_hpc.app.controller_lost import after_controller_lost
from exaserve_hpc.app.ha_rank import run_ha_rank
from exaserve_hpc.app.requeue_watch import start_requeue_watch
from exaserve_hpc.app.router_rank import check_router_count, run_router_rank
from exaserve_hpc.bootstrap import (
    ControllerInfo, NodeInventory, exchange_inventories, publish_controller, wait_for_controller
)
from exaserve_hpc.config.schema import SiteConfig, load_site, resolve_site
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.batch import JobEnvironment, detect_job_environment
from exaserve_hpc.batch.base import RankInfo, Role, _mpi_comm, role_for
from exaserve_hpc.batch.slurm.accounts import check_quota_accounts
from exaserve_hpc.quota.keys import key_file_problems
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, curve_available, make_curve_keys

log = logging.getLogger("exaserve.launch")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", help="site name or YAML path; default $EXASERVE_SITE or local")
    parser.add_argument("--job-dir", help="the job's shared directory (default $EXASERVE_JOB_DIR)")
    parser.add_argument("--port", type=int, help="gateway port on rank 0 (default gateway.port; 0: any free port, "
                                                 "published in the job directory)")
    parser.add_argument("--host", help="gateway address or interface on rank 0 (default gateway.interface, "
                                       "else gateway.host)")
    parser.add_argument("--no-curve", action="store_true", help="plain TCP control plane (CURVE is on by default)")
    parser.add_argument("--bootstrap-timeout", type=float, default=60.0,
                        help="seconds rank 0 waits for every rank's inventory")
    parser.add_argument("--capacity-floor", type=float, default=None,
                        help="requeue the job (checkpoint, exclude lost nodes) when live/planned nodes falls "
                             "below this fraction; 0: never (default requeue.capacity_floor)")
    parser.add_argument("--time-margin", type=float, default=None,
                        help="requeue this many seconds before the job's end time; 0: rely on the stop signal "
                             "(default requeue.time_margin)")
    parser.add_argument("--no-requeue", action="store_true", help="never requeue from the controller "
                                                                  "(requeue.enabled: false)")
    parser.add_argument("--replace-lost-nodes", action="store_true", default=None,
                        help="ask the batch system for a replacement node (a companion job whose agent joins) per "
                             "lost node (requeue.replace_lost_nodes)")
    parser.add_argument("--join", action="store_true",
                        help="run as a replacement node: join the controller published in --job-dir as an agent")
    parser.add_argument("--join-job-dir", help="run as a replacement node of the job whose directory this is")


def run_controller(site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                   inventories: list[NodeInventory], args: argparse.Namespace, comm=None) -> int:
    keys = None
    if not args.no_curve:
        if curve_available():
            keys = make_curve_keys(jobdir)
            install_block_hash_salt(jobdir)  # this run's: router and gateway hash prompts as its replicas do
        else:
            log.warning("this libzmq has no CURVE support: the control plane and the router run unauthenticated")
    nodes = [inv.node for inv in inventories]
    resume = job.resume_dir()
    try:
        if problems := key_file_problems(site):
            raise ControlPlaneError("; ".join(problems))
        check_quota_accounts(site)
        check_router_count(site, rank.size)  # router k runs on rank k
        plane = ControlPlane(site, PlaneSettings(
            node=rank.node, state_dir=jobdir.path, job_id=rank.job_id, restart=rank.restart, across_nodes=True,
            host=args.host, port=args.port, curve=keys, expected_agents=nodes, agent_in_thread=True,
            node_index=rank.rank, replica_env={CURVE_JOB_DIR_VARIABLE: str(jobdir.path.absolute())} if keys else {},
            restore_from=(resume,) if resume else (), show_progress=False))
    except Exception as exc:
        # The other ranks wait for the controller (in a bcast under MPI): tell them it is not coming, so the
        # whole step ends and the job gives its nodes back instead of holding them until its time limit.
        publish_controller(rank, jobdir, ControllerInfo(job_id=rank.job_id, restart=rank.restart, endpoint="",
                                                        nodes=nodes, error=str(exc)), comm)
        raise
    watch = start_requeue_watch(plane, site, job, rank, jobdir, nodes, args)
    if watch is not None:
        plane.add_stop_hook(watch.stop)
    endpoint = plane.controller.endpoint
    publish_controller(rank, jobdir, ControllerInfo(
        job_id=rank.job_id, restart=rank.restart, endpoint=endpoint, gateway_url=plane.url,
        server_public_key=keys.server_public.decode() if keys else "", nodes=nodes), comm)
    print(f"exaserve: rank 0 on {rank.node}: controller {endpoint}, gateway {plane.url}/v1, "
          f"{len(nodes)}/{rank.size} ranks reported ({', '.join(nodes)})", flush=True)
    return plane.run()  # serve.json in the job directory: `exaserve status --run-dir JOBDIR`


def run_joining_agent(site: SiteConfig, rank: RankInfo, jobdir: JobDir, timeout: float = 120.0) -> int:
    """A replacement node (companion job): join the main job's running controller as one more agent."""
    deadline = time.monotonic() + timeout
    data = None
    while time.monotonic() < deadline and not data:
        data = jobdir.read_json("controller.json")
        if not data:
            time.sleep(0.5)
    if not data:
        print(f"error: no controller.json in {jobdir.path} after {timeout:.0f}s; is the main job running?",
              file=sys.stderr)
        return 1
    info = ControllerInfo(**data)
    if info.error:
        print(f"error: the main job's controller did not start: {info.error}", file=sys.stderr)
        return 1
    return _run_agent_for(info, site, rank, jobdir,
                          f"replacement node {rank.node} joined {info.endpoint} (job {info.job_id})")


def run_agent(site: SiteConfig, rank: RankInfo, jobdir: JobDir, comm=None) -> int:
    info = wait_for_controller(rank, jobdir, comm)
    return _run_agent_for(info, site, rank, jobdir, f"rank {rank.rank} on {rank.node}: agent joined {info.endpoint}")


def _run_agent_for(info: ControllerInfo, site: SiteConfig, rank: RankInfo, jobdir: JobDir, joined: str) -> int:
    try:
        agent = build_agent(info, site, rank, jobdir)
    except GpuGrantError as exc:
        print(f"error: rank {rank.rank} on {rank.node}: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_GRANT
    stop_gracefully_on_signals(lambda: agent.shutdown(10.0))
    print(f"exaserve: {joined}", flush=True)
    return agent.run()


def cmd_launch(args: argparse.Namespace) -> int:
    # Everything a rank writes (job directory, controller state, L2 copies, snapshots) is the job
    # user's alone: on a shared cluster other users' jobs may share these nodes and filesystems.
    os.umask(0o077)
    site = load_site(resolve_site(args.site))
    job = detect_job_environment()
    try:
        rank = job.rank_info()
    except BootstrapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    comm = _mpi_comm() if rank.source == "mpi" else None
    os.environ[L2_RUN_VARIABLE] = f"job-{rank.job_id}"
    if args.join_job_dir:
        return run_joining_agent(site, rank, JobDir(Path(args.join_job_dir).expanduser()).ensure())
    job_dir = args.job_dir or os.environ.get("EXASERVE_JOB_DIR") or str(site.run_path / "jobs" / rank.job_id)
    jobdir = JobDir(Path(job_dir).expanduser()).ensure()
    if args.join:
        return run_joining_agent(site, rank, jobdir)
    inventories = exchange_inventories(rank, jobdir, NodeInventory.probe(rank), comm, timeout=args.bootstrap_timeout)
    try:
        if site.ha.etcd is not None:  # controller candidates elected through etcd (issue 18)
            return run_ha_rank(site, job, rank, jobdir, inventories, args)
        if role_for(rank.rank) is Role.CONTROLLER:
            return run_controller(site, job, rank, jobdir, inventories, args, comm)
        if rank.rank < site.router.count:  # several routers share the fleet: router k and a gateway on rank k
            code = run_router_rank(site, rank, jobdir, args, comm)
        else:
            code = run_agent(site, rank, jobdir, comm)
        if code == EXIT_CONTROLLER_LOST:  # rank 0 went silent: one surviving rank gives the job back
            nodes = (jobdir.read_json("controller.json") or {}).get("nodes") or [""]  # by rank
            after_controller_lost(job, rank, jobdir, nodes[0], not args.no_requeue and site.requeue.enabled)
        return code
    except (BootstrapError, ControlPlaneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


