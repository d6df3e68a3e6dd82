"""The routers and gateways of one control plane when several share the fleet (`router.count` > 1).

    routers = SeveralRouters(site, router0, router_bind, settings, make_router)
    controller = Controller(site, routers.group, ...)    # the group fans out loss and drain news
    routers.gateways(make_app, gateway_bind, publish, port).start()   # `exaserve serve` only

`exaserve serve` (one machine, the tests): routers 1..N-1 live in this process beside router 0, each
with its own gateway on its own port (gateway.port + k, or a free one when gateway.port is 0; a fixed
router.frontend_port / backend_port likewise + k), each gateway's uvicorn in a thread.

`exaserve launch`: router k runs on rank k with its own gateway (app/router_rank.py). It registers
by writing JOBDIR/routers/rank-K.json (endpoints, gateway URL, this run's job id and restart) before its
node's agent connects; placement waits for every node's agent, so the group (which reads those files
whenever the fleet asks for the routers' endpoints, until all have come) knows every router before the
first replica starts. A router that never registers is logged and left out: replicas connect to the
others.

With `ha.etcd` (app/ha_rank.py) router k runs on rank k whoever leads; the leader's plane takes its own
rank's router as router 0 of its group (PlaneSettings.local_router, not stopped with the plane) and adopts
every other registration of this run except those of lost nodes (agent/adoption.py).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc.addresses import http_url
from exaserve_hpc.agent.adoption import adopt, adoptable_ranks
from exaserve_hpc.gateway.app import site_admission
from exaserve_hpc.gateway.http_limits import HttpLimits
from exaserve_hpc.gateway.server import gateway_server
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.router.router_group import RouterGroup
from exaserve_hpc.router.router_link import RemoteRouter

log = logging.getLogger("exaserve.control")

ROUTERS_DIR = "routers"  # JOBDIR/routers/rank-K.json: a router rank's registration
DISCOVER_EVERY = 0.1  # seconds between looks for registrations still missing


def router_file(rank: int) -> str:
    return f"{ROUTERS_DIR}/rank-{rank}.json"


def gateway_admission(site, ledger, across_nodes: bool, rank: int = 0):
    """The admission (quota limits) of this process's gateways. `exaserve serve`: one for all of them, shared
    by their threads, so every limit holds exactly; `exaserve launch`: gateway k, on rank k, holds its part of
    each limit, the parts adding up to the configured one (gateway/admission.py)."""
    gateways = site.router.count if across_nodes else 1
    return site_admission(site, ledger, (rank, gateways))


def run_tag(job_id: str, restart: int) -> str:
    """A registration is this run's (not one left by the run before a requeue) when its tag matches."""
    return f"{job_id}.{restart}"


class SeveralRouters:
    def __init__(self, site, router0, router_bind: str, settings, make_router: Callable[[int, int], object]):
        """make_router(frontend_port, backend_port) -> a started ZmqRouter (serve's routers 1..N-1)."""
        self.site = site
        self.count = site.router.count
        self.local = [router0]  # routers in this process, router 0 first
        # An HA leader's router 0 is its own rank's, which outlives the leadership (settings.local_router)
        self.group = RouterGroup([router0], borrowed=(router0,) if settings.local_router is not None else ())
        self._servers: list = []
        self.on_change: Callable[[], None] = lambda: None  # a router joined (launch): serve.json is written again
        if not settings.across_nodes:
            r = site.router
            for k in range(1, self.count):
                router = make_router(r.frontend_port + k if r.frontend_port else 0,
                                     r.backend_port + k if r.backend_port else 0)
                self.local.append(router)
                self.group.add(router)
        else:
            self._discovery = RouterDiscovery(self.group, Path(settings.state_dir),
                                              run_tag(settings.job_id, settings.restart),
                                              adoptable_ranks(self.count, settings.node_index if
                                                              settings.local_router is not None else 0),
                                              settings.curve, on_joined=lambda: self.on_change(),
                                              lost_nodes=settings.lost_nodes)
            self.group.discover = self._discovery.poll

    # ---------------------------------------------------------------- serve's extra gateways

    def start_gateways(self, make_app: Callable[[str], object], listen: Callable[[int], object], publish: str,
                       port: int) -> list[str]:
        """A gateway per local router beyond the first (uvicorn in a thread each); their URLs."""
        urls = []
        for k, router in enumerate(self.local[1:], start=1):
            listener = listen(port + k if port else 0)
            url = http_url(publish, listener.getsockname()[1])
            server = gateway_server(make_app(router.frontend_endpoint), log_level="warning", access_log=False,
                                    grace=self.site.gateway.stop_grace, limits=HttpLimits.from_site(self.site))
            thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True,
                                      name=f"exaserve-gateway-{k}")
            thread.start()
            self._servers.append((server, thread, listener))
            self.group.gateways[k] = url
            urls.append(url)
        return urls

    def stop_gateways(self) -> None:
        """Each extra gateway stops taking requests and finishes its open ones (as the main one does)."""
        for server, _, _ in self._servers:
            server.should_exit = True
        for _, thread, listener in self._servers:
            thread.join(self.site.gateway.stop_grace + 10.0)
            listener.close()
        self._servers = []

    def stop(self) -> None:
        self.stop_gateways()
        self.group.stop()


class RouterDiscovery:
    """Rank 0: adds each router rank's registration (JOBDIR/routers/rank-K.json) to the group once."""

    def __init__(self, group: RouterGroup, job_dir: Path, tag: str, ranks, curve=None,
                 clock: Callable[[], float] = time.monotonic, on_joined: Callable[[], None] = lambda: None,
                 lost_nodes=()):
        self.group, self.job_dir, self.tag, self.curve, self.clock = group, job_dir, tag, curve, clock
        self.lost_nodes = tuple(lost_nodes)  # an HA leader adopts no router of a lost node (the old leader's)
        self.on_joined = on_joined
        self.missing = set(ranks)
        self._next = 0.0
        self._lock = threading.Lock()

    def poll(self, force: bool = False) -> None:
        if not self.missing or (self.clock() < self._next and not force):
            return
        joined = False
        with self._lock:
            self._next = self.clock() + DISCOVER_EVERY
            for rank in sorted(self.missing):
                info: Optional[dict] = JobDir(self.job_dir).read_json(router_file(rank))
                if info and info.get("run") == self.tag and info.get("node") in self.lost_nodes:
                    self.missing.discard(rank)  # this run's, on a lost node: never adopted
                    log.warning("router of rank %d on %s left out: its node is lost", rank, info.get("node"))
                    continue
                if not adopt(info, self.tag, self.lost_nodes):
                    continue
                self.missing.discard(rank)
                self.group.add(RemoteRouter(info, curve=self.curve).start(), info.get("gateway_url", ""))
                log.info("router of rank %d on %s joined: backend %s, gateway %s", rank, info.get("node"),
                         info["backend"], info.get("gateway_url"))
                joined = True
        if joined:
            try:
                self.on_joined()
            except Exception:  # the job directory's listing is a convenience; routing goes on without it
                log.exception("could not list the routers in the job directory")
