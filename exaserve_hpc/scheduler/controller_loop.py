"""The controller's thread: its loop, each message under its own guard, and its liveness.

`Controller` (controller.py) inherits this loop; the loop owns the ROUTER socket. Every round it reads what
agents sent (each message decoded, checked and handled under its own guard: a bad one is dropped and
counted against its peer, exaserve_hpc/peer_guard.py), runs work queued from other threads, ticks every
`scheduler.tick_interval` (reading the socket again first, so what arrived while the loop was busy counts
before any node is judged silent) and sends the handlers' outbox. An exception in a tick or a queued
command is logged once and the loop goes on: nothing a message or a policy does ends the thread.
`liveness()` says what keeps the service from working (for /health).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from exaserve_hpc.protocol import DecodeError, decode, encode
from exaserve_hpc.scheduler.message_checks import invalid

log = logging.getLogger("exaserve.controller")

STALLED = 30.0  # seconds without a loop round after which /health calls the controller stalled


class ControllerLoop:
    """The thread's half of the Controller (which sets socket, fleet, peers, router and the rest)."""

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
        if self.socket is not None:
            if not self._thread.is_alive():
                problems.append("controller thread stopped")
            elif self.loop_at and time.monotonic() - self.loop_at > STALLED:
                problems.append(f"controller loop stalled for {time.monotonic() - self.loop_at:.0f}s")
        if not self.router.routing():  # RouterPort: its loop (in a group, every member's) stopped
            problems.append("router thread stopped")
        return problems

    def _flush(self) -> None:
        """Send what the handlers left in the fleet's outbox (the only place the socket is written)."""
        with self.fleet.lock:
            out = self.fleet.take_outbox()
        if out and not self.acting():
            return  # deposed (ha/): nothing this controller queued may reach an agent
        for agent_id, message in out:
            try:
                self.socket.send_multipart([agent_id.encode(), encode(message)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("cannot reach agent %s: %s", agent_id, exc)
