"""The controller's channel to a router on another rank (router.count > 1 under `exaserve launch`).

    control = RouterControl(zmq_router, host, curve=keys).start()   # on router rank k, beside its router
    remote = RemoteRouter(info, curve=keys).start()                 # on rank 0, one per remote router
    remote.replica_lost("m/r0001", "node n3 lost")                  # what the controller tells every router
    remote.snapshot()                                               # its last report (counters, loads)

On one process the controller calls the router object's methods (ZmqRouter.replica_lost / drain /
snapshot). A router on another node gets the same calls as typed messages over one ZeroMQ pair: rank 0
connects a DEALER to the router rank's control ROUTER (a CURVE server admitting only the job's key,
like the router's own sockets). Every REPORT_INTERVAL rank 0 asks for a report and the router answers
with its snapshot's counters and per-replica outstanding requests, which RouterGroup adds up.

Commands are fire-and-forget: a router that is gone (its node lost) misses them, and a router that
comes back has forgotten every replica anyway. `alive` is False once no report came for
REPORT_MISSES intervals; the group then leaves that router out of the sums.

Canary rollouts: the admin API changes router 0's table (and those of routers in the same process);
each report request carries that table, and a remote router takes it when it differs from its own,
so a rollout reaches every router within REPORT_INTERVAL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Literal, Optional

import msgspec
import zmq

from exaserve_hpc.router.canary import Rollout
from exaserve_hpc.router.zmq_router import bind
from exaserve_hpc.transport import secure_client, secure_server

log = logging.getLogger(__name__)

REPORT_INTERVAL = 1.0  # seconds between snapshot requests
REPORT_MISSES = 3
POLL_MS = 100


class RouterCommand(msgspec.Struct, tag="router_command"):
    op: Literal["lost", "drain", "report"]
    replica_id: str = ""
    cause: str = ""
    # with "report": router 0's rollout table (canary.Rollout.as_dict each), which this router then follows
    rollouts: Optional[list[dict]] = None


class RouterReport(msgspec.Struct, tag="router_report"):
    snapshot: dict  # the router's snapshot; per replica only id, outstanding and queue depth (see summary())


_codec_decoder = msgspec.msgpack.Decoder(RouterCommand | RouterReport)
_encoder = msgspec.msgpack.Encoder()


def summary(snapshot: dict) -> dict:
    """What rank 0 needs of a remote router's snapshot: counters, and per replica its own outstanding
    requests (3,072 replicas' full entries would be ~1 MB a second for nothing)."""
    slim = {k: v for k, v in snapshot.items() if k not in ("replicas", "rollouts")}
    slim["replicas"] = [{"replica_id": r["replica_id"], "model": r["model"], "outstanding": r["outstanding"]}
                        for r in snapshot.get("replicas", [])]
    return slim


class RouterControl:
    """Router rank's side: applies rank 0's commands to the local router and answers report requests."""

    def __init__(self, router, host: str, port: int = 0, curve=None, context: Optional[zmq.Context] = None):
        self.router = router
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._zap = None
        if curve is not None:
            self._zap = secure_server(self.socket, curve, self.context, "router control")
        self.endpoint = bind(self.socket, host, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-router-control", daemon=True)
        self.last_command = 0.0  # monotonic time rank 0 was last heard

    def start(self) -> "RouterControl":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.socket.close(linger=0)
        if self._zap is not None:
            self._zap.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(POLL_MS):
                continue
            try:
                peer, frame = self.socket.recv_multipart(zmq.NOBLOCK)
                command = _codec_decoder.decode(frame)
            except (ValueError, zmq.Again, msgspec.DecodeError) as exc:
                log.warning("router control: dropping a bad message: %s", exc)
                continue
            self.last_command = time.monotonic()
            if not isinstance(command, RouterCommand):
                continue
            if command.op == "lost":
                self.router.replica_lost(command.replica_id, command.cause)
            elif command.op == "drain":
                self.router.drain(command.replica_id)
            else:
                if command.rollouts is not None:
                    self.router.call(lambda d, table=command.rollouts: follow_rollouts(d.rollouts, table))
                report = RouterReport(snapshot=summary(self.router.snapshot()))
                self.socket.send_multipart([peer, _encoder.encode(report)])


def follow_rollouts(table, rollouts: list[dict]) -> None:
    """Make a RolloutTable hold exactly `rollouts` (router 0's, as Rollout.as_dict gives them)."""
    wanted = {r["model"]: Rollout(**r) for r in rollouts}
    if wanted != table.rollouts:
        table.rollouts = wanted
        log.info("rollouts now %s", [r.as_dict() for r in wanted.values()])


class RemoteRouter:
    """Rank 0's handle on a router of another rank: what the controller calls on a ZmqRouter."""

    def __init__(self, info: dict, curve=None, context: Optional[zmq.Context] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.info = info  # routers/rank-K.json: rank, node, frontend, backend, control, gateway_url
        self.frontend_endpoint = info["frontend"]
        self.backend_endpoint = info["backend"]
        self.clock = clock
        self.context = context or zmq.Context.instance()
        self._curve = curve
        self._commands: "deque[RouterCommand]" = deque()
        self._snapshot: dict = {}
        self._reported_at: Optional[float] = None
        self._started_at = clock()
        self.rollouts: Callable[[], Optional[list[dict]]] = lambda: None  # router 0's table (RouterGroup sets it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"exaserve-router-link-{info.get('rank')}",
                                        daemon=True)

    def start(self) -> "RemoteRouter":
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        last = self._reported_at if self._reported_at is not None else self._started_at
        return self.clock() - last < REPORT_INTERVAL * REPORT_MISSES

    # RouterPort (router/port.py): a router of another rank routes while its reports arrive
    @property
    def backend_endpoints(self) -> list[str]:
        return [self.backend_endpoint]

    def routing(self) -> bool:
        return self.alive

    # ---------------------------------------------------------------- what the controller calls

    def replica_lost(self, replica_id: str, cause: str) -> None:
        self._commands.append(RouterCommand(op="lost", replica_id=replica_id, cause=cause))

    def drain(self, replica_id: str) -> None:
        self._commands.append(RouterCommand(op="drain", replica_id=replica_id))

    def snapshot(self) -> dict:
        return dict(self._snapshot)

    # ---------------------------------------------------------------- the link's thread

    def _run(self) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        if self._curve is not None:
            secure_client(sock, self._curve)
        sock.connect(self.info["control"])
        next_report = 0.0
        try:
            while not self._stop.is_set():
                while self._commands:
                    self._send(sock, self._commands.popleft())
                now = self.clock()
                if now >= next_report:
                    self._send(sock, RouterCommand(op="report", rollouts=self.rollouts()))
                    next_report = now + REPORT_INTERVAL
                if sock.poll(POLL_MS):
                    self._receive(sock)
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, command: RouterCommand) -> None:
        try:
            sock.send(_encoder.encode(command), zmq.NOBLOCK)
        except zmq.Again:  # the router is gone and its pipe is full: what it misses no longer matters
            pass

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(100):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = _codec_decoder.decode(frame)
            except msgspec.DecodeError as exc:
                log.warning("router link %s: undecodable report: %s", self.info.get("control"), exc)
                continue
            if isinstance(message, RouterReport):
                self._snapshot = message.snapshot
                self._reported_at = self.clock()
