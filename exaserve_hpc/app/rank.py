"""`exaserve launch`: one rank of a batch job (srun starts one per node).

    srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 python -m exaserve_hpc.launcher --site S --job-dir D

Rank 0 builds the control plane (app/control_plane.py, the same as `exaserve serve`): router, controller,
gateway, and its own node's agent in a thread; every other rank runs its node's agent. The bootstrap
(bootstrap.py) decides the role, exchanges inventories and publishes the controller's address and
CURVE key in the job directory; after it, ranks only talk ZeroMQ, so a lost rank stops nobody.
Everything about the batch system (rank, job id, end time, requeue, more nodes) comes from jobenv/.

Stopping: SIGTERM (scancel, preemption) and SIGUSR1 (Slurm's warning before the time limit) are a
graceful stop on every rank: rank 0 writes the checkpoint, drains and stops; each agent stops its
replicas and removes its L2 files; every rank exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, curve_available, load_client_keys, make_curve_keys, secure_client
from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.bootstrap import ControllerInfo, NodeInventory, exchange_inventories, publish_controller, wait_for_controller
from exaserve_hpc.jobenv.base import RankInfo, Role, role_for, _mpi_comm
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.config.schema import SiteConfig, load_site, resolve_site
from exaserve_hpc.jobenv import JobEnvironment, detect_job_environment

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


def requeue_policy(site: SiteConfig, args: argparse.Namespace):
    """The site's requeue triggers, each overridden by its flag when given."""
    from exaserve_hpc.scheduler.requeue_policy import RequeuePolicy
    r = site.requeue
    return RequeuePolicy(capacity_floor=r.capacity_floor if args.capacity_floor is None else args.capacity_floor,
                         time_margin=r.time_margin if args.time_margin is None else args.time_margin)


# Slurm signals every task at once. An agent rank first leaves the stop to rank 0, which finishes the
# gateway's open streams (on every node's replicas) before it tells the agents to drain; if that order
# has not come after this long (rank 0 gone), the agent drains by itself, well within Slurm's KillWait.
AGENT_STOP_GRACE = 15.0


def stop_gracefully_on_signals(stop, grace: float = AGENT_STOP_GRACE) -> None:
    """An agent rank: TERM (scancel, preemption) and USR1 (time limit near) stop it: by rank 0's order,
    else by itself after `grace` seconds (SIGALRM, so `stop` runs on the agent's thread as a handler).
    Ctrl-C, which reaches every task, is the controller's to order."""
    def arm(sig, frame):
        print(f"exaserve: {signal.Signals(sig).name}: stopping (by rank 0's order, or in {grace:.0f}s)", flush=True)
        signal.setitimer(signal.ITIMER_REAL, grace)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, arm)
    signal.signal(signal.SIGALRM, lambda *_: stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_controller(site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                   inventories: list[NodeInventory], args: argparse.Namespace, comm=None) -> int:
    from exaserve_hpc.app.control_plane import ControlPlane, ControlPlaneError, PlaneSettings
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
        from exaserve_hpc.quota.keys import key_file_problems
        if problems := key_file_problems(site):
            raise ControlPlaneError("; ".join(problems))
        check_quota_accounts(site)
        from exaserve_hpc.app.router_rank import check_router_count
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


def check_quota_accounts(site: SiteConfig, **check) -> None:
    """Each quota group's Slurm account must exist and be the job user's to charge (issue: groups as Slurm
    sees them). Raises AccountError naming group, account and user; without Slurm accounting, only warns."""
    from exaserve_hpc.quota.accounts import AccountingUnavailable, check_accounts
    try:
        check_accounts(site, **check)  # check: the sacctmgr seam (run=, user=) for tests
    except AccountingUnavailable as exc:
        log.warning("%s; quota groups' accounts not checked", exc)


def start_requeue_watch(plane, site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                        nodes: list[str], args: argparse.Namespace):
    """Watch for a requeue trigger (scheduler/requeue_policy.py) when the job environment can requeue,
    and in any case for the batch script's stop-requested file."""
    from exaserve_hpc.app.requeue_watch import RequeueWatch
    requeue = not args.no_requeue and site.requeue.enabled and job.can_requeue
    replace = requeue and (site.requeue.replace_lost_nodes if args.replace_lost_nodes is None
                           else args.replace_lost_nodes)
    if replace:
        job.enable_node_requests(site, resolve_site(args.site), jobdir.path)
    return RequeueWatch(plane.controller, job, plane.keeper, jobdir.path, nodes, rank.node,
                        requeue_policy(site, args), replace_lost_nodes=replace,
                        request_stop=plane.request_stop, requeue=requeue).start()


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


def build_agent(info: ControllerInfo, site: SiteConfig, rank: RankInfo, jobdir: JobDir):
    """This node's agent for the published controller (with its CURVE key when it has one); its replica
    processes read the keys from the job directory the agent names to them. Raises GpuGrantError."""
    from exaserve_hpc.agent.node_agent import NodeAgent, default_l2_root
    keys = load_client_keys(jobdir, info.server_public_key) if info.server_public_key else None
    agent = NodeAgent(info.endpoint, rank.node, site.heartbeat.interval, node_index=rank.rank, hostname=rank.node,
                      l2_capacity=site.weight_cache.l2_capacity,
                      l2_root=str(default_l2_root(rank.node, site.weight_cache.l2_path)),
                      controller_timeout=site.heartbeat.controller_timeout, gpus_per_node=site.cluster.gpus_per_node,
                      replica_env={CURVE_JOB_DIR_VARIABLE: str(jobdir.path.absolute())} if keys else None)
    if keys is not None:
        secure_client(agent.socket, keys)
    return agent


def _run_agent_for(info: ControllerInfo, site: SiteConfig, rank: RankInfo, jobdir: JobDir, joined: str) -> int:
    from exaserve_hpc.agent.gpu_binding import GpuGrantError
    from exaserve_hpc.agent.node_agent import EXIT_BAD_GRANT
    try:
        agent = build_agent(info, site, rank, jobdir)
    except GpuGrantError as exc:
        print(f"error: rank {rank.rank} on {rank.node}: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_GRANT
    stop_gracefully_on_signals(lambda: agent.shutdown(10.0))
    print(f"exaserve: {joined}", flush=True)
    return agent.run()


def cmd_launch(args: argparse.Namespace) -> int:
    from exaserve_hpc.app.control_plane import ControlPlaneError
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
    from exaserve_hpc.agent.node_agent import L2_RUN_VARIABLE  # this job's L2 directories: never another job's of ours
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
            from exaserve_hpc.app.ha_rank import run_ha_rank
            return run_ha_rank(site, job, rank, jobdir, inventories, args)
        if role_for(rank.rank) is Role.CONTROLLER:
            return run_controller(site, job, rank, jobdir, inventories, args, comm)
        if rank.rank < site.router.count:  # several routers share the fleet: router k and a gateway on rank k
            from exaserve_hpc.app.router_rank import run_router_rank
            code = run_router_rank(site, rank, jobdir, args, comm)
        else:
            code = run_agent(site, rank, jobdir, comm)
        from exaserve_hpc.agent.node_agent import EXIT_CONTROLLER_LOST
        if code == EXIT_CONTROLLER_LOST:  # rank 0 went silent: one surviving rank gives the job back
            from exaserve_hpc.app.controller_lost import after_controller_lost
            nodes = (jobdir.read_json("controller.json") or {}).get("nodes") or [""]  # by rank
            after_controller_lost(job, rank, jobdir, nodes[0], not args.no_requeue and site.requeue.enabled)
        return code
    except (BootstrapError, ControlPlaneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m exaserve_hpc.launcher ARGS` is `exaserve launch ARGS`."""
    from exaserve_hpc.cli import main as cli_main
    return cli_main(["launch", *(sys.argv[1:] if argv is None else argv)])
