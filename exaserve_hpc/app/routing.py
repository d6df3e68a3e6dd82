"""The control plane's routing half: how `exaserve serve`, rank 0 of `exaserve launch` (app/control_plane.py)
and router k on rank k (app/router_rank.py) make their routers and gateways from the site config.

    router = make_router(site, bind, frontend_port, backend_port, curve)   # a started ZmqRouter
    router, routers = plane_routers(site, settings, bind, closers)         # router 0, or a RouterGroup
    app = plane_gateway_app(site, frontend, controller, router, ...)       # the gateway with admin routes
    server = gateway_server(app, on_signal=...)                            # gateway/server.py

Kept apart from app/control_plane.py, which builds the rest (checkpoints, controller, agent, state keeper)
and owns the shutdown order. app/control_plane.py re-exports ControlPlaneError, which callers know from there.
"""

from __future__ import annotations

import time
from typing import Callable

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.app.several_routers import SeveralRouters
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.gateway.admin_api import serving_admin_routes
from exaserve_hpc.gateway.app import create_app
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.gateway.server import StartError
from exaserve_hpc.router.breaker import BreakerSettings
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.policies import policy_for_site
from exaserve_hpc.router.zmq_router import ZmqRouter

# A problem that stops the control plane before it serves; the message names the setting. The gateway's
# listener (gateway/server.py) raises it too, so it is defined there.
ControlPlaneError = StartError


def router_policy(site: SiteConfig):
    """The routing policy the site's router section asks for, with its settings (router/policies.py)."""
    return policy_for_site(site.router, site.batching)


def dispatch_settings(site: SiteConfig) -> DispatchSettings:
    r = site.router
    return DispatchSettings(max_attempts=r.max_attempts, request_timeout=r.request_timeout,
                            first_token_timeout=r.first_token_timeout,
                            replica_expiry=r.replica_heartbeat * r.replica_misses,
                            stall_timeout=r.stall_timeout or 0.0,
                            breaker=BreakerSettings(failures=r.breaker_failures, cooloff=r.breaker_cooloff))


def make_router(site: SiteConfig, bind: str, frontend_port: int, backend_port: int, curve=None):
    """A started router (its own dispatcher) on `bind`; a port it cannot take is a ControlPlaneError."""
    dispatcher = Dispatcher(router_policy(site), dispatch_settings(site), {m.model_name for m in site.models})
    try:
        return ZmqRouter(dispatcher, bind, frontend_port, backend_port, curve=curve).start()
    except Exception as exc:  # zmq.ZMQError: a busy port, an address we cannot bind
        raise ControlPlaneError(f"router: cannot listen on {bind} (frontend_port {frontend_port}, backend_port "
                                f"{backend_port}): {exc}; set router.frontend_port / router.backend_port (0: any "
                                f"free port) or router.interface") from exc


def plane_routers(site: SiteConfig, settings, router_bind: str, closers: list[Callable[[], None]]):
    """A control plane's router 0 and, with router.count > 1, the SeveralRouters around it (None with one):
    (what the controller, status and /metrics see: router 0 or the group, the SeveralRouters). `settings`
    is the plane's PlaneSettings; what this starts is appended to `closers`, to undo if building fails."""
    if settings.local_router is not None and site.router.count > 1:  # an HA leader's own rank's router
        router = settings.local_router
    else:
        router = make_router(site, router_bind, site.router.frontend_port, site.router.backend_port,
                             settings.curve)
        closers.append(router.stop)
    if site.router.count == 1:
        return router, None
    routers = SeveralRouters(site, router, router_bind, settings,
                             lambda fp, bp: make_router(site, router_bind, fp, bp, settings.curve))
    closers.append(routers.stop)
    return routers.group, routers


def plane_gateway_app(site: SiteConfig, frontend: str, controller, router, gateway_host: str, curve, *,
                      admin_key, ledger, admission):
    """A gateway app over the router at `frontend` (router 0's; serve's other gateways, their router's), with
    the admin routes over `router` (router 0 or the group) and the controller."""
    created = int(time.time())
    models = [ModelInfo(name=m.model_name, max_seq_len=m.max_seq_len, created=created) for m in site.models]
    client = RouterClient(frontend, models, status=controller.status,
                          ready=lambda: fleet_can_serve(controller), curve=curve)
    return create_app(client, site, admin_routes=serving_admin_routes(
        site, router, controller, gateway_host, admin_key=admin_key),
        admin_key=admin_key, ledger=ledger, admission=admission)


def fleet_can_serve(controller) -> bool:
    """/health's answer (the controller's view): the controller and router run, and some replica is serving
    with every node it runs on known to the controller and not declared lost. A replica whose only agent
    was lost, or one still pending, cannot serve, however the router's table looks at that moment."""
    if controller.serving_count() <= 0:  # 0 also while the controller or the router is not running
        return False
    agents = getattr(controller, "agents", None)
    fleet = getattr(controller, "fleet", None)
    if agents is None or fleet is None:  # a controller without the fleet's tables (a test's stand-in)
        return True
    with fleet.lock:
        for record in controller.replicas.values():
            if record.state is not ReplicaState.SERVING:
                continue
            assignment = getattr(record, "assignment", None)
            nodes = [n for n in (assignment.nodes if assignment is not None else (record.agent_id,)) if n]
            if nodes and all(n in agents and not agents[n].lost for n in nodes):
                return True
    return False
