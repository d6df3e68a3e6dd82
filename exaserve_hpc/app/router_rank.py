"""`exaserve launch` on ranks 1 .. router.count-1: a router and its gateway on this node, beside its agent.

    rank 0      controller + router 0 + gateway 0 + agent
    rank k < N  router k + gateway k + agent            (this module; N = router.count)
    rank k >= N agent

After rank 0 publishes the controller (bootstrap: address and CURVE key), a router rank:
  1. binds its router (the job's CURVE server key, read from the job directory like every rank's keys),
     the router's control socket (router/router_link.py: rank 0's loss/drain news, its reports) and its
     gateway's port, on this node's addresses (router.interface / gateway.interface as on rank 0);
  2. registers: JOBDIR/routers/rank-K.json (this run's job id and restart, endpoints, gateway URL), before
  3. its node's agent connects: placement waits for every node's agent, so rank 0 knows this router
     before any replica starts, and every replica connects to it (app/several_routers.py);
  4. serves: the gateway in a thread, the agent in the main thread (stopped as any agent rank's is).
A stop signal stops this gateway taking requests at once (its open ones finish, at most 10 s), and the
agent as any agent rank's: by rank 0's order, else by itself after AGENT_STOP_GRACE; then the router.
Losing this node loses only this router's in-flight requests: every replica also serves the others.

With `ha.etcd`, ranks 0 .. N-1 are controller candidates too (app/ha_rank.py): each runs its RankRouter
for the whole run, whether or not it leads, and the leader's control plane uses its own rank's router
as its local one and adopts the others (agent/adoption.py), so a leader's loss leaves the other gateways
serving.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc.addresses import AddressError, http_url, resolve_listen
from exaserve_hpc.agent import faults
from exaserve_hpc.agent.gpu_binding import GpuGrantError
from exaserve_hpc.agent.node_agent import EXIT_BAD_GRANT
from exaserve_hpc.app.agents import agent_from_site, stop_gracefully_on_signals
from exaserve_hpc.app.routing import ControlPlaneError, make_router
from exaserve_hpc.app.several_routers import gateway_admission, router_file, run_tag
from exaserve_hpc.bootstrap import ControllerInfo, wait_for_controller
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.controller_state import CHECKPOINT_FILE, CheckpointFormatError, load_state
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.gateway.admin_api import ADMIN_KEY_FILE
from exaserve_hpc.gateway.app import create_app
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.gateway.http_limits import HttpLimits
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.gateway.server import gateway_server, listen_socket
from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.batch.base import RESUME_VARIABLE, RankInfo
from exaserve_hpc.quota.ledger import UsageLedger, ledger_dir
from exaserve_hpc.router.router_link import RouterControl
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, CurveKeys

log = logging.getLogger("exaserve.launch")


def router_keys(jobdir: JobDir, info: ControllerInfo) -> Optional[CurveKeys]:
    """The job's keys, server secret included: this router is a CURVE server for the job's client key,
    as rank 0's is. None when rank 0 runs without CURVE."""
    if not info.server_public_key:
        return None
    keys = jobdir.path / "keys"
    try:
        found = CurveKeys(info.server_public_key.encode(), (keys / "server.key").read_bytes(),
                          (keys / "client.pub").read_bytes(), (keys / "client.key").read_bytes())
        install_block_hash_salt(jobdir)  # this router and its gateway hash prompts as the job's replicas do
        return found
    except OSError as exc:
        raise BootstrapError(f"router rank: the job's keys in {keys} cannot be read ({exc.strerror}); the job "
                             "directory must be shared by every node") from exc


def check_router_count(site: SiteConfig, size: int) -> None:
    """router.count routers need that many ranks (router k runs on rank k)."""
    if site.router.count > size:
        raise ControlPlaneError(f"router.count is {site.router.count} but the job has {size} node(s); allowed: "
                                f"1 to {size} (router k runs on rank k), or submit with --nodes {site.router.count}")


class RankRouter:
    """Router k, its control socket and gateway k on rank k, registered in JOBDIR/routers/rank-K.json. Its
    lifetime is the rank's, not a controller's: under `ha.etcd` a standby runs it whether or not it leads,
    and the rank's control plane, when it leads, uses it as its local router (app/ha_rank.py)."""

    def __init__(self, site: SiteConfig, rank: RankInfo, jobdir: JobDir, args, keys: Optional[CurveKeys],
                 controller: Callable[[], Optional[ControllerInfo]]):
        r, g = site.router, site.gateway
        try:
            bind, _ = resolve_listen(r.host, r.interface, rank.node,
                                     "router.interface" if r.interface else "router.host", True)
            if args.host:
                gateway_bind, publish = resolve_listen(args.host, None, rank.node, "--host", True)
            else:
                gateway_bind, publish = resolve_listen(g.host, g.interface, rank.node,
                                                       "gateway.interface" if g.interface else "gateway.host", True)
        except AddressError as exc:
            raise ControlPlaneError(str(exc)) from exc
        self.bind = bind
        self.router = make_router(site, bind, r.frontend_port, r.backend_port, keys)
        self.control = RouterControl(self.router, bind, curve=keys).start()
        self.listener = listen_socket(gateway_bind, g.port if args.port is None else args.port,
                                      "gateway.port" if args.port is None else "--port")
        self.url = http_url(publish, self.listener.getsockname()[1])
        app, self.ledger, self.admission = gateway_app(site, self.router, jobdir, keys, rank, controller)
        self.server = gateway_server(app, log_level="warning", access_log=False, grace=g.stop_grace,
                                     limits=HttpLimits.from_site(site))
        self.stop_grace = g.stop_grace
        self.gateway = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listener]},
                                        name="exaserve-gateway", daemon=True)
        self.gateway.start()
        self.rank, self.jobdir = rank, jobdir

    def register(self) -> None:
        """JOBDIR/routers/rank-K.json: rank 0 (or an HA leader) adds this router to its group."""
        rank = self.rank
        self.jobdir.write_json(router_file(rank.rank), {
            "run": run_tag(rank.job_id, rank.restart), "rank": rank.rank, "node": rank.node,
            "frontend": self.router.frontend_endpoint, "backend": self.router.backend_endpoint,
            "control": self.control.endpoint, "gateway_url": self.url, "published_at": time.time()})
        print(f"exaserve: rank {rank.rank} on {rank.node}: router {self.router.backend_endpoint}, gateway "
              f"{self.url}/v1", flush=True)

    def stop_gateway(self) -> None:
        """Stop taking requests at once; the open ones finish (at most gateway.stop_grace, then an error event)."""
        self.server.should_exit = True

    def stop(self) -> None:
        self.server.should_exit = True
        self.gateway.join(self.stop_grace + 10.0)
        self.listener.close()
        self.control.stop()
        self.router.stop()
        self.ledger.close()


def run_router_rank(site: SiteConfig, rank: RankInfo, jobdir: JobDir, args, comm=None) -> int:
    info = wait_for_controller(rank, jobdir, comm)
    keys = router_keys(jobdir, info)
    service = RankRouter(site, rank, jobdir, args, keys, lambda: info)
    late = faults.delay("router_late")
    if late:  # a test's router that comes after placement: registered once the agent has started
        timer = threading.Timer(late, service.register)
        timer.daemon = True
        timer.start()
    else:
        service.register()
    try:
        try:
            agent = agent_from_site(site, info.endpoint, rank.node, rank.rank, keys,
                                    {CURVE_JOB_DIR_VARIABLE: str(jobdir.path.absolute())} if keys else None)
        except GpuGrantError as exc:
            print(f"error: rank {rank.rank} on {rank.node}: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_GRANT
        stop_gracefully_on_signals(lambda: agent.shutdown(10.0))
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # the gateway stops taking requests at once
            chained = signal.getsignal(sig)
            signal.signal(sig, lambda s, f, chained=chained: (service.stop_gateway(), chained(s, f)))
        return agent.run()
    finally:
        service.stop()


def restore_ledger(ledger, jobdir: JobDir) -> Optional[Path]:
    """The earlier runs' usage, as rank 0's plane restores its own (app/control_plane.py): the job's checkpoint
    (this job directory's, else a predecessor job's) and the ledger files past its positions; every ledger
    file without a readable one. Returns the checkpoint used."""
    resume = os.environ.get(RESUME_VARIABLE)
    for directory in (jobdir.path, *([Path(resume)] if resume else [])):
        path = directory / CHECKPOINT_FILE
        if not path.exists():
            continue
        try:
            state = load_state(path)
        except (OSError, KeyError, CheckpointFormatError) as exc:  # e.g. being written: the ledger files alone
            log.warning("checkpoint %s unreadable (%s); usage restored from the ledger files alone", path, exc)
            break
        ledger.restore(state)
        return path
    ledger.restore(None)
    return None


def gateway_app(site: SiteConfig, router, jobdir: JobDir, keys, rank: RankInfo,
                controller: Callable[[], Optional[ControllerInfo]]):
    """This rank's gateway over its own router: the same app as rank 0's (keys, quotas, the job's usage
    ledger beside the job directory), with a status of this router (the fleet's is the controller's:
    `controller()` names the one of the moment, a new leader's after a failover under ha.etcd)."""
    created = int(time.time())
    models = [ModelInfo(name=m.model_name, max_seq_len=m.max_seq_len, created=created) for m in site.models]

    def status() -> dict:
        snapshot, info = router.snapshot(), controller()
        return {"site": site.site, "role": f"router rank {rank.rank} on {rank.node}",
                "controller": {"endpoint": info.endpoint if info else "",
                               "gateway": info.gateway_url if info else ""},
                "router": {k: v for k, v in snapshot.items() if k != "replicas"},
                "replicas": [{"replica_id": e["replica_id"], "model": e["model"], "node": e["node"],
                              "queue_depth": e["queue_depth"], "outstanding": e["outstanding"]}
                             for e in snapshot.get("replicas", [])]}

    client = RouterClient(router.frontend_endpoint, models, status=status,
                          ready=lambda: bool(router.snapshot().get("replicas")), curve=keys)
    try:  # rank 0 wrote it before it published the controller
        admin_key = site.router.admin_key or (jobdir.path / ADMIN_KEY_FILE).read_text().strip()
    except OSError:
        admin_key = None
    ledger = UsageLedger(ledger_dir(site, jobdir.path.parent), half_life=site.gateway.fair_share_half_life)
    restore_ledger(ledger, jobdir)  # before the admission: fair share is seeded from the ledger's usage
    # this gateway's part of each quota limit: gateway k of router.count (app/several_routers.py)
    admission = gateway_admission(site, ledger, True, rank.rank)
    return create_app(client, site, admin_key=admin_key, ledger=ledger, admission=admission), ledger, admission
