"""`exaserve launch`: what every rank of the Slurm job runs (srun starts one per node).

    srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 exaserve launch --site S --job-dir D

Rank 0 runs the router, the controller thread, the HTTP gateway, and the node agent of its own
node (in a thread); every other rank runs its node's agent. The bootstrap (bootstrap.py) decides
the role, exchanges inventories and publishes the controller's address and CURVE key in the
job directory; after it, ranks only talk ZeroMQ, so a lost rank stops nobody.

The rendered sbatch script runs it as `python -m exaserve_hpc.slurm.launch_rank ...` with the
install's own interpreter, so ranks need no PATH set up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from ..bootstrap import (
    CURVE_JOB_DIR_VARIABLE, BootstrapError, ControllerInfo, JobDir, NodeInventory, RankInfo, Role, curve_available,
    detect_rank, exchange_inventories, load_client_keys, make_curve_keys, publish_controller, role_for, secure_client,
    wait_for_controller, _mpi_comm,
)
from ..config import SiteConfig, load_site, resolve_site

log = logging.getLogger("exaserve.launch")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", help="site name or YAML path; default $EXASERVE_SITE or local")
    parser.add_argument("--job-dir", help="the job's shared directory (default $EXASERVE_JOB_DIR)")
    parser.add_argument("--port", type=int, help="gateway port on rank 0 (default gateway.port; 0: any free port)")
    parser.add_argument("--host", help="gateway address on rank 0 (default gateway.host)")
    parser.add_argument("--no-curve", action="store_true", help="plain TCP control plane (CURVE is on by default)")
    parser.add_argument("--bootstrap-timeout", type=float, default=60.0,
                        help="seconds rank 0 waits for every rank's inventory")
    parser.add_argument("--capacity-floor", type=float, default=0.5,
                        help="requeue the job (checkpoint, exclude lost nodes) when live/planned nodes falls "
                             "below this fraction; 0: never")
    parser.add_argument("--time-margin", type=float, default=0.0,
                        help="requeue this many seconds before the time limit; 0: rely on the sbatch stop signal")
    parser.add_argument("--no-requeue", action="store_true", help="never requeue from the controller")
    parser.add_argument("--replace-lost-nodes", action="store_true",
                        help="ask Slurm for a replacement node (a companion job whose agent joins) per lost node")
    parser.add_argument("--join", action="store_true",
                        help="run as a replacement node: join the controller published in --job-dir as an agent")


def _make_agent(endpoint: str, rank: RankInfo, site: SiteConfig, jobdir: JobDir, keys=None):
    """This node's agent; with keys, it and its replica processes (which read the keys from the job
    directory the agent names to them) are CURVE clients of the controller and the router backend."""
    from ..agent.node_agent import NodeAgent, default_l2_root
    agent = NodeAgent(endpoint, rank.node, site.heartbeat.interval, node_index=rank.rank, hostname=rank.node,
                      l2_capacity=site.weight_cache.l2_capacity,
                      l2_root=str(default_l2_root(rank.node, site.weight_cache.l2_path)),
                      controller_timeout=site.heartbeat.controller_timeout,
                      replica_env={CURVE_JOB_DIR_VARIABLE: str(jobdir.path.absolute())} if keys is not None else None)
    if keys is not None:
        secure_client(agent.socket, keys)
    return agent


def run_controller(site: SiteConfig, rank: RankInfo, jobdir: JobDir, inventories: list[NodeInventory],
                   args: argparse.Namespace, comm=None) -> int:
    from ..launch import build_router, ensure_checkpoints, gateway_server, listen_socket, write_state
    from ..router.admin_api import serving_admin_routes
    from ..router.backend import ModelInfo
    from ..router.client import RouterClient
    from ..router.gateway import create_app
    from ..scheduler.controller import Controller

    keys = None
    if not args.no_curve:
        if curve_available():
            keys = make_curve_keys(jobdir)
        else:
            log.warning("this libzmq has no CURVE support: the control plane and the router run unauthenticated")
    ensure_checkpoints(site, show_progress=False)
    host = args.host or site.gateway.host
    listener = listen_socket(host, site.gateway.port if args.port is None else args.port)
    url = f"http://{host}:{listener.getsockname()[1]}"
    router = build_router(site, across_nodes=True, curve=keys)  # with keys: CURVE servers, job key only
    nodes = [inv.node for inv in inventories]
    controller = Controller(site, router, host=site.router.bind_host(across_nodes=True), curve=keys,
                            expected_agents=nodes,
                            placement_grace=max(10.0, 3 * site.heartbeat.expiry))
    restore_checkpoint(controller, jobdir)
    controller.start()
    requeuer = start_requeuer(controller, rank, jobdir, nodes, args)
    endpoint = controller.endpoint  # published under this node's name when bound to every interface
    own_agent = _make_agent(controller.endpoint, rank, site, jobdir, keys)
    agent_thread = threading.Thread(target=own_agent.run, name="exaserve-agent-rank0", daemon=True)
    agent_thread.start()
    publish_controller(rank, jobdir, ControllerInfo(
        job_id=rank.job_id, restart=rank.restart, endpoint=endpoint, gateway_url=url,
        server_public_key=keys.server_public.decode() if keys else "", nodes=nodes), comm)
    write_state(jobdir.path, url, site)  # `exaserve status --run-dir JOBDIR` finds the gateway
    print(f"exaserve: rank 0 on {rank.node}: controller {endpoint}, gateway {url}/v1, "
          f"{len(nodes)}/{rank.size} ranks reported ({', '.join(nodes)})", flush=True)

    created = int(time.time())
    models = [ModelInfo(name=m.model_name, max_seq_len=m.max_seq_len, created=created) for m in site.models]
    client = RouterClient(router.frontend_endpoint, models, status=controller.status,
                          ready=lambda: controller.serving_count() > 0, curve=keys)
    app = create_app(client, site, admin_routes=serving_admin_routes(site, router, controller, host))
    server = gateway_server(app, log_level=os.environ.get("EXASERVE_HTTP_LOG", "warning"),
                             timeout_graceful_shutdown=10, access_log=False)
    try:
        server.run(sockets=[listener])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        print("exaserve: rank 0 stopping: draining replicas on every node", flush=True)
        if requeuer is not None:
            requeuer.stop()
        controller.shutdown(drain_timeout=10.0, wait=20.0)
        agent_thread.join(20)
        controller.stop()
        router.stop()
        listener.close()
    return 0


def restore_checkpoint(controller, jobdir: JobDir) -> None:
    """A requeued run starts from the state the previous run checkpointed (slurm/requeue.py)."""
    from ..checkpoint import CheckpointFormatError, load_state
    from .requeue import CHECKPOINT_FILE
    path = jobdir.path / CHECKPOINT_FILE
    if not path.exists():
        return
    try:
        state = load_state(path)
    except (OSError, KeyError, CheckpointFormatError) as exc:
        print(f"exaserve: checkpoint {path} unreadable ({exc}); starting from the site's plan", flush=True)
        return
    controller.restore(state)
    print(f"exaserve: restored state from {path} (job {state.job_id} restart {state.restart}, "
          f"{len(state.placement)} replicas, excluded {','.join(state.excluded_nodes) or 'none'})", flush=True)


def start_requeuer(controller, rank: RankInfo, jobdir: JobDir, nodes: list[str], args: argparse.Namespace):
    """Watch for a requeue trigger (scheduler/requeue.py) when running as a Slurm job."""
    if args.no_requeue or rank.source == "local" or not rank.job_id.isdigit():
        return None
    from ..scheduler.requeue import RequeuePolicy
    from .client import CliSlurmClient, SlurmError
    from .requeue import Requeuer
    from .sbatch import default_launcher
    client = CliSlurmClient()
    deadline = None
    if args.time_margin > 0:
        try:
            job = client.job(int(rank.job_id))
            deadline = job.start_time + job.time_limit_s if job.time_limit_s and job.start_time else None
        except SlurmError as exc:
            log.warning("cannot read job %s's time limit: %s", rank.job_id, exc)
    policy = RequeuePolicy(capacity_floor=args.capacity_floor, time_margin=args.time_margin)
    companions = None
    if args.replace_lost_nodes:
        from .replacement import CompanionJobs
        companions = CompanionJobs(client, rank.job_id, jobdir.path, str(resolve_site(args.site)),
                                   default_launcher())
    return Requeuer(controller, jobdir.path, rank.job_id, rank.restart, client, nodes, rank.node, policy,
                    deadline, companions=companions).start()


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
    return _run_agent_for(info, site, rank, jobdir,
                          f"replacement node {rank.node} joined {info.endpoint} (job {info.job_id})")


def run_agent(site: SiteConfig, rank: RankInfo, jobdir: JobDir, comm=None) -> int:
    info = wait_for_controller(rank, jobdir, comm)
    return _run_agent_for(info, site, rank, jobdir, f"rank {rank.rank} on {rank.node}: agent joined {info.endpoint}")


def _run_agent_for(info: ControllerInfo, site: SiteConfig, rank: RankInfo, jobdir: JobDir, joined: str) -> int:
    """This node's agent, connected to the published controller (with its CURVE key when it has one)."""
    keys = load_client_keys(jobdir, info.server_public_key) if info.server_public_key else None
    agent = _make_agent(info.endpoint, rank, site, jobdir, keys)
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown(10.0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every task; the controller orders the stop
    print(f"exaserve: {joined}", flush=True)
    return agent.run()


def cmd_launch(args: argparse.Namespace) -> int:
    site = load_site(resolve_site(args.site))
    rank = detect_rank()
    comm = _mpi_comm() if rank.source == "mpi" else None
    job_dir = args.job_dir or os.environ.get("EXASERVE_JOB_DIR") or str(site.run_path / "jobs" / rank.job_id)
    jobdir = JobDir(Path(job_dir).expanduser()).ensure()
    if getattr(args, "join", False):
        return run_joining_agent(site, rank, jobdir)
    inventories = exchange_inventories(rank, jobdir, NodeInventory.probe(rank), comm, timeout=args.bootstrap_timeout)
    try:
        if role_for(rank.rank) is Role.CONTROLLER:
            return run_controller(site, rank, jobdir, inventories, args, comm)
        return run_agent(site, rank, jobdir, comm)
    except BootstrapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m exaserve_hpc.slurm.launch_rank ARGS` is `exaserve launch ARGS`."""
    from ..cli import main as cli_main
    return cli_main(["launch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
