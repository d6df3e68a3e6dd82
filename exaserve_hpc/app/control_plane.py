"""One control plane, built the same way by `exaserve serve` (app/serve.py) and rank 0 of `exaserve launch`
(app/rank.py): model checkpoints, the router, the controller (restored from its checkpoint when
one is there), this node's agent, the HTTP gateway with the admin routes, and the state keeper. How the
routers and gateways are made from the site config is app/routing.py's (router k's rank uses it too).

    plane = ControlPlane(site, PlaneSettings(node="n1", state_dir=job_dir, across_nodes=True, ...))
    plane.add_stop_hook(watch.stop)     # run first when the plane stops
    plane.run()                         # serves until SIGINT, SIGTERM or SIGUSR1 (or request_stop()); 0

Addresses (addresses.py): `gateway.interface` / `router.interface` (ib0, or an address) choose where
each listens; a wildcard is published as the node's address, never 0.0.0.0; IPv6 in brackets.

The one shutdown order, whatever stopped it (a signal: Ctrl-C, scancel's TERM, Slurm's USR1 before
the time limit; a requeue; a stop file):
  1. the gateway stops taking requests (its listener closes, /health is 503); open streams get
     gateway.stop_grace (10 s) to finish while every replica still serves, and those still open then end
     with an SSE error event (server_stopping) and `data: [DONE]` (gateway/server.py gateway_server);
  2. stop hooks (the requeue watch, which releases replacement-node jobs);
  3. the controller's state is written (begun at the signal itself, before agents drain);
  4. every agent drains and stops its replicas (controller.shutdown), and this node's agent exits,
     removing its L2 files;
  5. controller, router and listener close; serve.json goes.
A second signal while stopping is answered with a line and does not cut the drain short.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from exaserve_hpc.addresses import AddressError, http_url, resolve_listen
from exaserve_hpc.agent import faults
from exaserve_hpc.agent.gpu_binding import GpuGrantError
from exaserve_hpc.app.agent_supervisor import AgentSupervisor
from exaserve_hpc.app.agents import agent_from_site, agent_process
from exaserve_hpc.app.routing import ControlPlaneError, plane_gateway_app, plane_routers
from exaserve_hpc.app.several_routers import gateway_admission
from exaserve_hpc.app.state_keeper import StateKeeper
from exaserve_hpc.cache.checkpoint import CheckpointError, TinyModelSpec, ensure_tiny_checkpoint
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.controller_state import CHECKPOINT_FILE, CheckpointFormatError, load_state
from exaserve_hpc.engine.registry import engine_spec
from exaserve_hpc.gateway.admin_api import admin_key_for
from exaserve_hpc.gateway.http_limits import HttpLimits
from exaserve_hpc.gateway.server import STOP_SIGNALS, gateway_server, listen_socket
from exaserve_hpc.observability.collector import watch_fleet
from exaserve_hpc.quota.ledger import UsageLedger, ledger_dir
from exaserve_hpc.controller.loop import Controller

log = logging.getLogger("exaserve.control")
console = Console(stderr=True)
ServeError = ControlPlaneError  # the name `exaserve serve` used


def ensure_checkpoints(site: SiteConfig, show_progress: bool = True) -> None:
    """Create missing tiny checkpoints (with a progress bar); refuse a missing real one."""

    for model in site.models:
        engine = engine_spec(model.engine)
        if not engine.needs_weights:
            continue
        directory = site.model_dir(model)
        if model.tiny is None or not engine.reads_tiny:
            if not (directory / "manifest.json").exists():
                raise ControlPlaneError(
                    f"model {model.model_name}: no checkpoint at {directory} (manifest.json missing); "
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
                raise ControlPlaneError(f"model {model.model_name}: {exc}") from exc


def write_state(run_dir: Path, url: str, site: SiteConfig, routers: Optional[list[dict]] = None) -> Path:
    """Where `exaserve status` finds a running server; mode 0600 (it names a control endpoint).
    `routers`: with several (router.count > 1), each router's endpoints and gateway URL."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    state = {"url": url, "pid": os.getpid(), "host": socket.gethostname(), "site": site.site, "started": time.time()}
    if routers:
        state["routers"] = routers
        state["gateways"] = [r["gateway"] for r in routers if r.get("gateway") and r.get("state") != "lost"]
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    return path


def written_by(state: dict, url: str, pid: int, host: str) -> bool:
    """Whether serve.json's `state` is this process's (pure): ha/ leaders on different nodes may share a pid,
    and a deposed leader must not remove the new leader's file, so the host and the URL must match too."""
    return state.get("pid") == pid and state.get("host") == host and state.get("url") == url


@dataclass
class PlaneSettings:
    node: str                               # this node's name: its agent's id; what wildcards publish
    state_dir: Path                         # serve.json and controller-state.h5 (run_dir, or the job directory)
    job_id: str = "local"
    restart: int = 0
    across_nodes: bool = False              # a job's plane: peers on other nodes connect to it
    host: Optional[str] = None              # --host: the gateway's address, over gateway.interface/host
    port: Optional[int] = None              # --port: over gateway.port (0: any free port)
    curve: Any = None                       # transport.CurveKeys: CURVE router and controller
    expected_agents: Optional[list[str]] = None
    agent_in_thread: bool = False           # rank 0 runs its node's agent in-process; serve starts a process
    node_index: int = 0
    replica_env: dict[str, str] = field(default_factory=dict)
    restore_from: tuple[Path, ...] = ()     # more directories whose checkpoint may restore (a successor's)
    show_progress: bool = True
    drain_timeout: float = 10.0
    drain_wait: float = 20.0
    start_agent: bool = True                # False: this node's agent already runs (an HA candidate's, app/ha_rank.py)
    restore_state: Any = None               # a ControllerState to start from before any checkpoint (ha/: etcd's)
    # ha/ with router.count > 1: this rank's running router (app/router_rank.py's RankRouter), used as
    # router 0 and left running when the plane stops; its gateway's URL; nodes whose routers are not adopted
    local_router: Any = None
    local_gateway: str = ""
    local_admission: Any = None  # that gateway's part of the quota limits, shared with the leader's own gateway
    lost_nodes: tuple[str, ...] = ()


class ControlPlane:
    def __init__(self, site: SiteConfig, settings: PlaneSettings):
        self.site, self.settings = site, settings
        self._stop_hooks: list[Callable[[], None]] = []
        self._closers: list[Callable[[], None]] = []  # what is up so far, to undo if building fails
        self._checkpointed = threading.Lock()
        self._checkpoint_done = False
        self.stopping = False
        self.failure = ""  # why the plane stopped by itself, if it did: run() then returns 1
        self._stop_asked = False
        self.server = None
        self.agent_supervisor = None  # `exaserve serve`'s agent process, kept running (app/agent_supervisor.py)
        try:
            self._build()
        except BaseException:
            for close in reversed(self._closers):
                with contextlib.suppress(Exception):
                    close()
            raise

    # ---------------------------------------------------------------- building

    def _build(self) -> None:
        site, s = self.site, self.settings
        ensure_checkpoints(site, show_progress=s.show_progress)
        gateway = site.gateway
        try:
            if s.host:
                bind, publish = resolve_listen(s.host, None, s.node, "--host", s.across_nodes)
            else:
                bind, publish = resolve_listen(gateway.host, gateway.interface, s.node,
                                               "gateway.interface" if gateway.interface else "gateway.host",
                                               s.across_nodes)
            router_bind, _ = resolve_listen(site.router.host, site.router.interface, s.node,
                                            "router.interface" if site.router.interface else "router.host",
                                            s.across_nodes)
        except AddressError as exc:
            raise ControlPlaneError(str(exc)) from exc
        self.gateway_host, self.gateway_publish = bind, publish
        self.listener = listen_socket(bind, gateway.port if s.port is None else s.port,
                                      "gateway.port" if s.port is None else "--port")
        self._closers.append(self.listener.close)
        self.url = http_url(publish, self.listener.getsockname()[1])

        # self.router: what the controller, status and /metrics see (router 0, or the group of router.count);
        # self.routers: the SeveralRouters sharing the fleet (router.count > 1; app/several_routers.py), else None
        self.router, self.routers = plane_routers(site, s, router_bind, self._closers)
        grace = {"placement_grace": max(10.0, 3 * site.heartbeat.expiry)} if s.expected_agents else {}
        self.controller = Controller(site, self.router, host=router_bind, curve=s.curve,
                                     expected_agents=s.expected_agents, **grace)
        self._closers.append(self.controller.stop)
        self.restored_from = self._restore()
        self.controller.start()
        self.keeper = StateKeeper(self.controller, Path(s.state_dir) / CHECKPOINT_FILE, s.job_id, s.restart,
                                  interval=site.requeue.checkpoint_interval).start()
        self._closers.append(self.keeper.stop)
        watch_fleet(self.controller, self.router, self.keeper)  # the fleet on the gateway's /metrics
        self._start_agent()
        self.app = self._app()
        self.gateway_urls = [self.url]
        if self.routers is not None and not s.across_nodes:  # serve: a gateway per router, in this process
            self.gateway_urls += self.routers.start_gateways(
                self._gateway_app, lambda port: listen_socket(bind, port, "gateway.port"), publish,
                gateway.port if s.port is None else s.port)
            self.add_stop_hook(self.routers.stop_gateways)
        if self.routers is not None:
            self.router.gateways[0] = s.local_gateway or self.url

    def _restore(self) -> Optional[Path]:
        """A requeued (or successor) run starts from the state the previous run wrote."""
        if self.settings.restore_state is not None:  # a new leader's: fresher than any periodic checkpoint
            self.controller.restore(self.settings.restore_state)
            return None
        for directory in (Path(self.settings.state_dir), *self.settings.restore_from):
            path = directory / CHECKPOINT_FILE
            if not path.exists():
                continue
            try:
                state = load_state(path)
            except (OSError, KeyError, CheckpointFormatError) as exc:
                log.warning("checkpoint %s unreadable (%s); starting from the site's plan", path, exc)
                print(f"exaserve: checkpoint {path} unreadable ({exc}); starting from the site's plan", flush=True)
                return None
            self.controller.restore(state)
            print(f"exaserve: restored state from {path} (job {state.job_id} restart {state.restart}, "
                  f"{len(state.placement)} replicas, excluded {','.join(state.excluded_nodes) or 'none'})",
                  flush=True)
            return path
        return None

    def _start_agent(self) -> None:
        s, site = self.settings, self.site
        if not s.start_agent:
            self.agent_supervisor, self.agent_thread = None, None
            return
        endpoint = self.controller.endpoint
        if not s.agent_in_thread:  # restarted when it dies on its own (app/agent_supervisor.py)
            self.agent_supervisor = AgentSupervisor(
                lambda: agent_process(endpoint, s.node, site, env=s.replica_env), self.controller, s.node,
                on_give_up=self._agent_gave_up)
            self.agent_thread = None
            self._closers.append(self.agent_supervisor.kill)
            self.controller.process_check = self.agent_supervisor.check  # liveness: the child checked directly
            return
        try:
            agent = agent_from_site(site, endpoint, s.node, s.node_index, s.curve, s.replica_env)
        except GpuGrantError as exc:
            raise ControlPlaneError(str(exc)) from exc
        self.agent_supervisor = None
        self.agent_thread = threading.Thread(target=agent.run, name="exaserve-agent-rank0", daemon=True)
        self.agent_thread.start()
        thread, node = self.agent_thread, s.node
        # liveness: this node's agent is a thread of this process (alive while it runs; gone once it ends)
        self.controller.process_check = lambda n: (thread.is_alive() or False) if n == node else None

    def _agent_gave_up(self, why: str) -> None:
        """This node's agent cannot be kept running (it refused the node's GPU grant, it keeps dying): stop,
        and exit 1, rather than wait for replicas that cannot come."""
        if not self.stopping:
            self.failure = why
            self.request_stop(why)

    def _app(self):
        self._admin_key = admin_key_for(self.site, self.settings.state_dir)  # the site's, or one made for this run
        # A job's ledger lives beside its job directory (JOB_ROOT/usage), not in it: a requeued job, or the
        # successor that replaces it with the lost nodes excluded, appends to the same ledger.
        ledger_home = Path(self.settings.state_dir).parent if self.settings.across_nodes else self.settings.state_dir
        self._ledger = UsageLedger(ledger_dir(self.site, ledger_home),  # what a centre bills from
                                   half_life=self.site.gateway.fair_share_half_life)
        self._ledger.restore(self.controller.restored)  # the checkpoint's quota section, then the ledger past it
        self.keeper.quota = self._ledger.quota_state  # and every later checkpoint carries the ledger's figures
        self.add_stop_hook(self._ledger.close)
        self._admission = (self.settings.local_admission if self.settings.local_admission is not None else
                           gateway_admission(self.site, self._ledger, self.settings.across_nodes))
        return self._gateway_app(self.router.frontend_endpoint)

    def _gateway_app(self, frontend: str):
        """A gateway app over the router at `frontend` (router 0's; serve's other gateways, their router's)."""
        return plane_gateway_app(self.site, frontend, self.controller, self.router, self.gateway_host,
                                 self.settings.curve, admin_key=self._admin_key, ledger=self._ledger,
                                 admission=self._admission)

    # ---------------------------------------------------------------- running and stopping

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        self._stop_hooks.append(hook)

    def routers_table(self) -> Optional[list[dict]]:
        """Each router's endpoints and gateway (router.count > 1; None with one router)."""
        if self.routers is None:
            return None
        return [{k: r[k] for k in ("index", "frontend", "backend", "gateway", "state")}
                for r in self.router.snapshot()["routers"]]

    def abandon(self, why: str) -> None:
        """End run() without the job's stop order (ha/: this plane is no longer the leader's): no checkpoint,
        no drain; the agents and their replicas are the new leader's."""
        self.abandoned = why
        self.request_stop(why)

    def request_stop(self, why: str) -> None:
        """End run() gracefully from any thread (a requeue handed to a successor, a stop file)."""
        print(f"exaserve: stopping: {why}", flush=True)
        self._stop_asked = True
        if self.server is not None:
            self.server.should_exit = True

    def _on_signal(self, sig: int) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.agent_supervisor is not None:  # the same signal may reach the agent: not a death to repair
            self.agent_supervisor.stop()
        self.controller.stopping()  # agents stopping replicas from now on are not moved (Slurm signals them too)
        print(f"exaserve: {signal.Signals(sig).name} received: checkpoint, drain, stop", flush=True)
        # Write now, while every replica is still placed: agents may get the same signal and drain theirs.
        threading.Thread(target=self.checkpoint_once, name="exaserve-stop-checkpoint", daemon=True).start()

    def _on_early_signal(self, sig: int, frame) -> None:
        self._on_signal(sig)
        self._stop_asked = True
        if self.server is not None:
            self.server.should_exit = True

    def checkpoint_once(self) -> None:
        with self._checkpointed:
            if not self._checkpoint_done:
                self._checkpoint_done = True
                self.keeper.save()

    def run(self) -> int:
        # serve.json says the server is up: from then on a signal must stop it gracefully, also in the
        # moment before the gateway's own handlers are in place (the default for USR1 and TERM is death).
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_early_signal)
        state_file = write_state(Path(self.settings.state_dir), self.url, self.site, self.routers_table())
        if self.routers is not None:  # routers of other ranks join later: list them as they come
            self.routers.on_change = lambda: write_state(state_file.parent, self.url, self.site, self.routers_table())
        late = faults.delay("gateway_late")
        if late:  # a test's window between serve.json and the gateway's own signal handlers
            time.sleep(late)
        self.server = gateway_server(self.app, on_signal=self._on_signal,
                                     log_level=os.environ.get("EXASERVE_HTTP_LOG", "warning"),
                                     grace=self.site.gateway.stop_grace, limits=HttpLimits.from_site(self.site),
                                     access_log=False)
        if self._stop_asked:  # asked before the gateway existed
            self.server.should_exit = True
        try:
            self.server.run(sockets=[self.listener])
        finally:
            self.shutdown()
            with contextlib.suppress(OSError, ValueError):
                if written_by(json.loads(state_file.read_text()), self.url, os.getpid(), socket.gethostname()):
                    state_file.unlink()
        return 1 if self.failure else 0

    def shutdown(self) -> None:
        """The one shutdown order (see the module's docstring)."""
        self.stopping = True
        for sig in STOP_SIGNALS:  # a second Ctrl-C must not cut the drain short
            signal.signal(sig, lambda *_: print("exaserve: already stopping; waiting for replicas to drain",
                                                flush=True))
        for hook in self._stop_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one failed hook must not leave replicas running
                log.exception("stop hook %s failed", hook)
        if getattr(self, "abandoned", ""):  # another leader runs the fleet: close ours, touch nothing of theirs
            for close in reversed(self._closers):
                with contextlib.suppress(Exception):
                    close()
            print(f"exaserve: stopped leading ({self.abandoned}); agents and replicas left to the new leader",
                  flush=True)
            return
        self.keeper.stop()
        self.checkpoint_once()
        print("exaserve: stopping: draining replicas on every node", flush=True)
        if self.agent_supervisor is not None:
            self.agent_supervisor.stop()  # an agent dying from here on is not replaced
        self.controller.shutdown(drain_timeout=self.settings.drain_timeout, wait=self.settings.drain_wait)
        if self.agent_thread is not None:
            self.agent_thread.join(self.settings.drain_wait)
        if self.agent_supervisor is not None:
            agent = self.agent_supervisor.stop()
            try:
                agent.wait(timeout=self.settings.drain_wait)
            except subprocess.TimeoutExpired:
                log.warning("node agent did not exit; killing it")
                agent.kill()
                agent.wait()
        self.controller.stop()
        self.router.stop()
        self.listener.close()
        print("exaserve: stopped: every replica and this node's agent have exited", flush=True)
