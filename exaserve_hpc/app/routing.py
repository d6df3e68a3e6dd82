"""The control plane's routing half: how `exaserve serve`, rank 0 of `exaserve launch` (app/control_plane.py)
and router k on rank k (app/router_rank.py) make their routers and gateways from the site config.

    router = make_router(site, bind, frontend_port, backend_port, curve)   # a started ZmqRouter
    router, routers = plane_routers(site, settings, bind, closers)         # router 0, or a RouterGroup
    app = plane_gateway_app(site, frontend, controller, router, ...)       # the gateway with admin routes
    server = gateway_server(app, on_signal=...)                            # its uvicorn, our signals

Kept apart from app/control_plane.py, which builds the rest (checkpoints, controller, agent, state keeper)
and owns the shutdown order. ControlPlaneError lives here because these builders raise it, and
app/control_plane.py imports from this module (it re-exports the error, which callers know from there).
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.router.breaker import BreakerSettings
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class ControlPlaneError(Exception):
    """A problem that stops the control plane before it serves; the message names the setting."""


def router_policy(site: SiteConfig):
    """The routing policy the site's router section asks for, with its settings (router/policies.py)."""
    from exaserve_hpc.router.policies import policy_for_site
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
    from exaserve_hpc.router.zmq_router import ZmqRouter
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
    from exaserve_hpc.app.several_routers import SeveralRouters  # several routers sharing the fleet (app/several_routers.py)
    routers = SeveralRouters(site, router, router_bind, settings,
                             lambda fp, bp: make_router(site, router_bind, fp, bp, settings.curve))
    closers.append(routers.stop)
    return routers.group, routers


def plane_gateway_app(site: SiteConfig, frontend: str, controller, router, gateway_host: str, curve, *,
                      admin_key, ledger, admission):
    """A gateway app over the router at `frontend` (router 0's; serve's other gateways, their router's), with
    the admin routes over `router` (router 0 or the group) and the controller."""
    from exaserve_hpc.gateway.admin_api import serving_admin_routes
    from exaserve_hpc.gateway.backend import ModelInfo
    from exaserve_hpc.gateway.router_client import RouterClient
    from exaserve_hpc.gateway.app import create_app
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
    from exaserve_hpc.agent.lifecycle import ReplicaState
    with fleet.lock:
        for record in controller.replicas.values():
            if record.state is not ReplicaState.SERVING:
                continue
            assignment = getattr(record, "assignment", None)
            nodes = [n for n in (assignment.nodes if assignment is not None else (record.agent_id,)) if n]
            if nodes and all(n in agents and not agents[n].lost for n in nodes):
                return True
    return False


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


def gateway_server(app, on_signal: Callable[[int], None] = lambda sig: None, *, grace: float = 10.0,
                   limits=None, **config):
    """A uvicorn server that stops on SIGINT, SIGTERM and SIGUSR1 and returns, so our shutdown runs.

    uvicorn re-raises the captured signal after its own shutdown, which would kill this process
    before the replicas are drained; we take that part out. on_signal(sig) runs first, in the handler
    (only when run in the main thread; a gateway in another thread is stopped with should_exit).

    Its stop never cuts a stream (issue 25 item 7): new connections are refused at once (the listener
    closes), requests already open get `grace` seconds (gateway.stop_grace) to finish, and those still
    open then end as the app's stop gate ends them (gateway/generation.py StopGate: an SSE error event
    `server_stopping` and `data: [DONE]`, or a 503), so uvicorn's own cut (its timeout_graceful_shutdown,
    a cancellation and a traceback per stream) is only a backstop 5 s later.
    `limits` (router/http_limits.HttpLimits; default the class's): the connection cap and timeouts.
    """
    import asyncio
    import threading

    import uvicorn
    from exaserve_hpc.gateway.http_limits import ConnectionGuard, HttpLimits, raise_fd_limit

    raise_fd_limit()
    limits = limits or HttpLimits()
    guard = ConnectionGuard(limits)
    gate = getattr(getattr(app, "state", None), "stop_gate", None)

    class GatewayServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            timer = None
            if gate is not None:
                gate.stopping = True  # new requests on open connections: 503; /health: 503

                def end_open_requests() -> None:
                    ended = gate.interrupt_all(f"the server is stopping and the request did not finish within "
                                               f"the stop grace ({grace:g}s, gateway.stop_grace); retry it")
                    if ended:
                        print(f"exaserve: stop grace ({grace:g}s) over: {ended} open request(s) ended with an "
                              "error event", flush=True)
                timer = asyncio.get_running_loop().call_later(grace, end_open_requests)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def handle(sig, frame):
                on_signal(sig)
                self.handle_exit(sig if sig == signal.SIGINT else signal.SIGTERM, frame)

            previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config.setdefault("log_config", None)  # uvicorn's lines go through our handlers (rate-limited, logs.py)
    config.setdefault("timeout_keep_alive", max(1, int(limits.keep_alive_timeout)))
    config["timeout_graceful_shutdown"] = int(grace) + 5  # the backstop (see above)
    server = GatewayServer(uvicorn.Config(app, http=guard.protocol_class(), **config))
    server.guard = guard
    return server
