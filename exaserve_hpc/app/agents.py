"""The node agent as every launch path makes it from the site config, and how an agent rank stops.

    agent = agent_from_site(site, endpoint, node, node_index, keys, replica_env)  # in this process
    process = agent_process(endpoint, node, site, env)                            # `exaserve serve`: a child
    agent = build_agent(info, site, rank, jobdir)                                 # an agent rank, from controller.json
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

from exaserve_hpc.agent.node_agent import NodeAgent, default_l2_root
from exaserve_hpc.bootstrap import ControllerInfo
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, CurveKeys, load_client_keys, secure_client


def agent_from_site(site: SiteConfig, endpoint: str, node: str, node_index: int, keys: Optional[CurveKeys] = None,
                    replica_env: Optional[dict[str, str]] = None) -> NodeAgent:
    """This node's agent for the controller at `endpoint`, sized and paced by the site (heartbeat, L2 cache,
    GPUs per node); a CURVE client of the controller with `keys`. Raises GpuGrantError."""
    agent = NodeAgent(endpoint, node, site.heartbeat.interval, node_index=node_index, hostname=node,
                      l2_capacity=site.weight_cache.l2_capacity,
                      l2_root=str(default_l2_root(node, site.weight_cache.l2_path)),
                      controller_timeout=site.heartbeat.controller_timeout, gpus_per_node=site.cluster.gpus_per_node,
                      replica_env=replica_env or None)
    if keys is not None:
        secure_client(agent.socket, keys)
    return agent


def agent_process(endpoint: str, node: str, site: SiteConfig, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """This node's agent as a child process (`exaserve serve`), with the same settings as agent_from_site:
    it dies with us. `env` is added to ours (CURVE_JOB_DIR_VARIABLE: where it and its replicas read the
    run's keys)."""
    command = [sys.executable, "-m", "exaserve_hpc.agent", "--controller", endpoint,
               "--agent-id", node, "--heartbeat", str(site.heartbeat.interval), "--die-with-parent",
               "--controller-timeout", str(site.heartbeat.controller_timeout),
               "--l2-capacity", str(int(site.weight_cache.l2_capacity)),
               "--l2-dir", str(default_l2_root(node, site.weight_cache.l2_path)),
               "--gpus-per-node", str(site.cluster.gpus_per_node)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def build_agent(info: ControllerInfo, site: SiteConfig, rank: RankInfo, jobdir: JobDir):
    """This node's agent for the published controller (with its CURVE key when it has one); its replica
    processes read the keys from the job directory the agent names to them. Raises GpuGrantError."""
    keys = load_client_keys(jobdir, info.server_public_key) if info.server_public_key else None
    return agent_from_site(site, info.endpoint, rank.node, rank.rank, keys,
                           {CURVE_JOB_DIR_VARIABLE: str(jobdir.path.absolute())} if keys else None)


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
