"""The control plane's routing half: how `exaserve serve`, rank 0 of `exaserve launch` (control_plane.py)
and router k on rank k (launcher/router_rank.py) make their routers and gateways from the site config.

    router = make_router(site, bind, frontend_port, backend_port, curve)   # a started ZmqRouter
    router, routers = plane_routers(site, settings, bind, closers)         # router 0, or a RouterGroup
    app = plane_gateway_app(site, frontend, controller, router, ...)       # the gateway with admin routes
    server = gateway_server(app, on_signal=...)                            # its uvicorn, our signals

Kept apart from control_plane.py, which builds the rest (checkpoints, controller, agent, state keeper)
and owns the shutdown order. ControlPlaneError lives here because these builders raise it, and
control_plane.py imports from this module (it re-exports the error, which callers know from there).
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable

from .config import SiteConfig
from .router.breaker import BreakerSettings
from .router.dispatch import Dispatcher, DispatchSettings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class ControlPlaneError(Exception):
    """A problem that stops the control plane before it serves; the message names the setting."""


def router_policy(site: SiteConfig):
    """The routing policy the site's router section asks for, with its settings (router/policies.py)."""
    from .router.policies import policy_for_site
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
    from .router.zmq_router import ZmqRouter
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
    from .several_routers import SeveralRouters  # several routers sharing the fleet (several_routers.py)
    routers = SeveralRouters(site, router, router_bind, settings,
                             lambda fp, bp: make_router(site, router_bind, fp, bp, settings.curve))
    closers.append(routers.stop)
    return routers.group, routers


def plane_gateway_app(site: SiteConfig, frontend: str, controller, router, gateway_host: str, curve, *,
                      admin_key, ledger, admission):
    """A gateway app over the router at `frontend` (router 0's; serve's other gateways, their router's), with
    the admin routes over `router` (router 0 or the group) and the controller."""
    from .router.admin_api import serving_admin_routes
    from .router.backend import ModelInfo
    from .router.client import RouterClient
    from .router.gateway import create_app
    created = int(time.time())
    models = [ModelInfo(name=m.model_name, max_seq_len=m.max_seq_len, created=created) for m in site.models]
    client = RouterClient(frontend, models, status=controller.status,
                          ready=lambda: controller.serving_count() > 0, curve=curve)
    return create_app(client, site, admin_routes=serving_admin_routes(
        site, router, controller, gateway_host, admin_key=admin_key),
        admin_key=admin_key, ledger=ledger, admission=admission)


def listen_socket(host: str, port: int, setting: str = "gateway.port"):
    """Bind the gateway's socket ourselves, so port 0 works and a busy port is a clear error at start."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ControlPlaneError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another port with "
                                f"--port (0 picks a free one) or set {setting}") from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def gateway_server(app, on_signal: Callable[[int], None] = lambda sig: None, **config):
    """A uvicorn server that stops on SIGINT, SIGTERM and SIGUSR1 and returns, so our shutdown runs.

    uvicorn re-raises the captured signal after its own shutdown, which would kill this process
    before the replicas are drained; we take that part out. on_signal(sig) runs first, in the handler.
    """
    import uvicorn

    class GatewayServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            def handle(sig, frame):
                on_signal(sig)
                self.handle_exit(sig if sig == signal.SIGINT else signal.SIGTERM, frame)

            previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GatewayServer(uvicorn.Config(app, **config))
