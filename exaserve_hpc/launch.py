"""`exaserve serve`: the whole system on this machine (the embedded default).

Starts, in this order: model checkpoints (created on first use for tiny
models), the router thread, the controller thread, one node agent process
(which starts one process per replica), and the HTTP gateway in the main
thread. Ctrl-C or SIGTERM stops the gateway, then the controller tells the
agent to drain and stop every replica, and we wait for every child before
exiting 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from .config import SiteConfig
from .router.policies import policy_for_site
from .router.breaker import BreakerSettings
from .router.dispatch import Dispatcher, DispatchSettings
from .router.zmq_router import ZmqRouter

log = logging.getLogger("exaserve.serve")
console = Console(stderr=True)


class ServeError(Exception):
    """A problem that stops `exaserve serve` before it serves; the message says what to do."""


@dataclass
class ServeOptions:
    host: Optional[str] = None
    port: Optional[int] = None
    run_dir: Optional[Path] = None
    ready_timeout: float = 120.0


def ensure_checkpoints(site: SiteConfig, show_progress: bool = True) -> None:
    """Create missing tiny checkpoints (with a progress bar); refuse a missing real one."""
    from .cache.checkpoint import CheckpointError, TinyModelSpec, ensure_tiny_checkpoint
    from .engine.registry import engine_spec

    for model in site.models:
        engine = engine_spec(model.engine)
        if not engine.needs_weights:
            continue
        directory = site.model_dir(model)
        if model.tiny is None or not engine.reads_tiny:
            if not (directory / "manifest.json").exists():
                raise ServeError(f"model {model.model_name}: no checkpoint at {directory} (manifest.json missing); "
                                 "set model_path to a checkpoint directory"
                                 + (", or add a `tiny:` section to create one" if engine.reads_tiny else
                                    f" (engine {model.engine} cannot read the tiny checkpoints `tiny:` creates)"))
            continue
        spec = TinyModelSpec(**model.tiny.model_dump())
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=console, disable=not show_progress, transient=True) as progress:
            task = progress.add_task(f"checkpoint {model.model_name}", total=None)

            def report(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            try:
                ensure_tiny_checkpoint(directory, spec, progress=report)
            except CheckpointError as exc:
                raise ServeError(f"model {model.model_name}: {exc}") from exc


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the gateway's socket ourselves, so port 0 works and a busy port gives a clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                         f"choose another port with --port (0 picks a free one) or set gateway.port") from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def start_agent(controller_endpoint: str, agent_id: str, heartbeat: float,
                l2_capacity: Optional[int] = None, l2_dir: Optional[str] = None,
                controller_timeout: float = 60.0) -> subprocess.Popen:
    command = [sys.executable, "-m", "exaserve_hpc.agent", "--controller", controller_endpoint,
               "--agent-id", agent_id, "--heartbeat", str(heartbeat), "--die-with-parent",
               "--controller-timeout", str(controller_timeout)]
    if l2_capacity is not None:
        command += ["--l2-capacity", str(int(l2_capacity))]
    if l2_dir is not None:
        command += ["--l2-dir", l2_dir]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL)


def router_policy(site: SiteConfig):
    """The routing policy the site's router section asks for, with its prefix settings."""
    return policy_for_site(site.router, site.batching)


def dispatch_settings(site: SiteConfig) -> DispatchSettings:
    r = site.router
    return DispatchSettings(max_attempts=r.max_attempts, request_timeout=r.request_timeout,
                            first_token_timeout=r.first_token_timeout,
                            replica_expiry=r.replica_heartbeat * r.replica_misses,
                            stall_timeout=r.stall_timeout or 0.0,
                            breaker=BreakerSettings(failures=r.breaker_failures, cooloff=r.breaker_cooloff))


def build_router(site: SiteConfig, across_nodes: bool = False, curve=None) -> ZmqRouter:
    """The site's router. `across_nodes`: a job's router (every interface by default); `curve`: the
    job's keys (bootstrap.CurveKeys), making frontend and backend CURVE servers that admit only its client."""
    r = site.router
    dispatcher = Dispatcher(router_policy(site), dispatch_settings(site), {m.model_name for m in site.models})
    return ZmqRouter(dispatcher, r.bind_host(across_nodes), r.frontend_port, r.backend_port, curve=curve).start()


def gateway_server(app, **config):
    """A uvicorn server that stops on SIGINT/SIGTERM and returns, so our cleanup runs.

    uvicorn re-raises the captured signal after its own shutdown, which would
    kill this process before the replicas are drained; we take that part out.
    """
    import contextlib

    import uvicorn

    class GatewayServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GatewayServer(uvicorn.Config(app, **config))


def serve(site: SiteConfig, options: ServeOptions) -> int:

    from .router.backend import ModelInfo
    from .router.client import RouterClient
    from .router.gateway import create_app
    from .router.admin_api import serving_admin_routes
    from .agent.node_agent import default_l2_root
    from .scheduler.controller import Controller

    host = options.host or site.gateway.host
    port = site.gateway.port if options.port is None else options.port
    run_dir = options.run_dir or site.run_path
    ensure_checkpoints(site)
    listener = listen_socket(host, port)
    port = listener.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    router = build_router(site)
    controller = Controller(site, router, host=site.router.bind_host(across_nodes=False)).start()
    agent_id = site.cluster.hostnames()[0]
    agent = start_agent(controller.endpoint, agent_id, site.heartbeat.interval, site.weight_cache.l2_capacity,
                        str(default_l2_root(agent_id, site.weight_cache.l2_path)), site.heartbeat.controller_timeout)
    created = int(time.time())
    models = [ModelInfo(name=m.model_name, max_seq_len=m.max_seq_len, created=created) for m in site.models]
    client = RouterClient(router.frontend_endpoint, models, status=controller.status,
                          ready=lambda: controller.serving_count() > 0)
    app = create_app(client, site, admin_routes=serving_admin_routes(site, router, controller, host))
    server = gateway_server(app, log_level=os.environ.get("EXASERVE_HTTP_LOG", "warning"),
                             timeout_graceful_shutdown=10, access_log=False)
    state_file = write_state(run_dir, url, site)
    wanted = sum(site.initial_replicas(m) for m in site.models)
    threading.Thread(target=announce_when_ready, args=(controller, url, site, wanted, options.ready_timeout),
                     daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the drain short
            signal.signal(sig, lambda *_: console.print("already stopping; waiting for replicas to drain"))
        console.print("[bold]stopping[/]: draining replicas")
        controller.shutdown(drain_timeout=10.0, wait=20.0)
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            log.warning("node agent did not exit; killing it")
            agent.kill()
            agent.wait()
        controller.stop()
        router.stop()
        listener.close()
        state_file.unlink(missing_ok=True)
        console.print("[bold]stopped[/]: every replica and the agent have exited")
    return 0


def announce_when_ready(controller, url: str, site: SiteConfig, wanted: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        serving = controller.serving_count()
        if serving != last:
            console.print(f"replicas serving: {serving}/{wanted}")
            last = serving
        if serving >= wanted:
            break
        time.sleep(0.2)
    model = site.models[0].model_name
    sys.stdout.write(
        f"\nexaserve is serving {', '.join(m.model_name for m in site.models)} at {url}/v1\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        f"\"max_tokens\": 16}}'\n"
        f"  status: exaserve status    metrics: {url}/metrics    stop: Ctrl-C\n\n")
    sys.stdout.flush()


def write_state(run_dir: Path, url: str, site: SiteConfig) -> Path:
    """Where `exaserve status` finds a running server; mode 0600 (it names a control endpoint)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid(), "site": site.site, "started": time.time()}, f)
    return path
