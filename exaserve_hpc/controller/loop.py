"""The controller (rank 0): its core (core.py) plus the thread that owns the ROUTER socket.

    controller = Controller(site, router, host, port, curve=keys).start()   # agents connect to .endpoint

Every node agent's DEALER connects to the socket. Every round the loop reads what agents sent (each message
decoded, checked and handled under its own guard: a bad one is dropped and counted against its peer,
exaserve_hpc/peer_guard.py), runs work queued from other threads, ticks every `scheduler.tick_interval`
(reading the socket again first, so what arrived while the loop was busy counts before any node is judged
silent) and sends the core's effects. An exception in a tick or a queued command is logged once and the
loop goes on: nothing a message or a policy does ends the thread. `liveness()` says what keeps the service
from working (for /health).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import zmq

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.peer_guard import PeerGuard
from exaserve_hpc.protocol import DecodeError, decode, encode
from exaserve_hpc.router.port import RouterPort
from exaserve_hpc.router.zmq_router import bind
from exaserve_hpc.controller.core import ControllerCore
from exaserve_hpc.controller.message_checks import invalid
from exaserve_hpc.transport import secure_server

log = logging.getLogger("exaserve.controller")

STALLED = 30.0  # seconds without a loop round after which /health calls the controller stalled
MAX_MESSAGE_BYTES = 16 << 20  # an agent's largest message (a heartbeat of a thousand replicas) is ~200 KiB


class Controller(ControllerCore):
    def __init__(self, site: SiteConfig, router: RouterPort, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic, context: Optional[zmq.Context] = None,
                 curve=None, expected_agents: Optional[list[str]] = None, placement_grace: float = 30.0,
                 demand_interval: float = 10.0, run_dir: Optional[Path] = None):
        """curve: transport.CurveKeys to make the control socket a CURVE server that admits only the job's
        client key (None: plain TCP, the single-machine default). The other arguments are the core's."""
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a peer sending more in one message is disconnected by ZeroMQ before anything is read
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._auth = secure_server(self.socket, curve, self.context) if curve is not None else None
        super().__init__(site, router, clock=clock, expected_agents=expected_agents,
                         placement_grace=placement_grace, demand_interval=demand_interval, run_dir=run_dir,
                         endpoint=bind(self.socket, host, port))
        self._stop = threading.Event()
        self.peers = PeerGuard()  # bad messages counted per peer; past a limit the peer is refused a while
        self._errors_logged: set[str] = set()
        self.loop_at = 0.0  # monotonic time the controller loop last went round (liveness)
        self._thread = threading.Thread(target=self._run, name="exaserve-controller", daemon=True)

    def start(self) -> "Controller":
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 10.0, wait: float = 20.0) -> None:
        """Tell every agent to drain and stop its replicas; wait until they all report stopped."""
        self.stopping()
        self.fleet.submit(lambda: self.shut_down_fleet(drain_timeout))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with self.fleet.lock:
                live = [r for r in self.replicas.values()
                        if r.agent_id and not r.state.terminal and r.state is not ReplicaState.PENDING]
            if not live:
                break
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.socket is not None:
            self.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()

    def status(self) -> dict:
        """The core's status with what the loop knows: messages dropped and peers refused (peer_guard.py)."""
        status = super().status()
        status["controller"].update(self.peers.status(time.monotonic()))
        return status

    def _run(self) -> None:
        tick = self.site.scheduler.tick_interval
        next_tick = 0.0
        while not self._stop.is_set():
            self.loop_at = time.monotonic()
            if self.socket.poll(min(100, int(tick * 1000))):
                self._receive()
            due = self.clock() >= next_tick
            if due:
                self._receive()  # what arrived while the loop was busy counts before any node is judged
            with self.fleet.lock:
                while not self.fleet.commands.empty():
                    self._guarded("a queued command", self.fleet.commands.get_nowait())
                if due:
                    now = self.clock()
                    self._guarded("the periodic tick", lambda: self.tick(now))
                    next_tick = now + tick
            self._flush()

    def _guarded(self, what: str, work: Callable[[], None]) -> None:
        """Run `work`; an exception is logged (once per distinct error) instead of ending the thread."""
        try:
            work()
        except Exception as exc:
            key = f"{what}: {type(exc).__name__}: {exc}"[:300]
            if key not in self._errors_logged and len(self._errors_logged) < 256:
                self._errors_logged.add(key)
                log.exception("controller: %s failed (the controller carries on)", what)

    def _receive(self) -> None:
        """Every waiting message (at most 1000), each under its own guard (exaserve_hpc/peer_guard.py)."""
        for _ in range(1000):
            try:
                peer, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not two frames
            now = time.monotonic()
            if self.peers.refused(peer, now):
                continue
            try:
                message = decode(frame)
            except DecodeError as exc:
                self._bad(peer, "undecodable", str(exc), now)
                continue
            why = invalid(message)
            if why:
                self._bad(peer, type(message).__name__, why, now)
                continue
            try:
                with self.fleet.lock:
                    self.handle(peer.decode(errors="replace"), message)
            except Exception as exc:
                self._bad(peer, f"{type(message).__name__}: {type(exc).__name__}", repr(exc), now)
                log.debug("handler failed", exc_info=True)
            self._flush()

    def _bad(self, peer: bytes, kind: str, detail: str, now: float) -> None:
        line = self.peers.bad(peer, kind, detail, now)
        if line:
            log.warning("controller: %s", line)

    def liveness(self) -> list[str]:
        """What keeps the service from working, for /health ([] when the controller and router run)."""
        problems = []
        if not self._thread.is_alive():
            problems.append("controller thread stopped")
        elif self.loop_at and time.monotonic() - self.loop_at > STALLED:
            problems.append(f"controller loop stalled for {time.monotonic() - self.loop_at:.0f}s")
        return problems + super().liveness()

    def _flush(self) -> None:
        """Send the core's effects (the only place the socket is written)."""
        for agent_id, message in self.take_effects():
            try:
                self.socket.send_multipart([agent_id.encode(), encode(message)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("cannot reach agent %s: %s", agent_id, exc)
