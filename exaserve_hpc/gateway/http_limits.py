"""Limits at the gateway's HTTP door (issue 25 item 3): what one local user can hold of a gateway process.

    guard = ConnectionGuard(HttpLimits.from_site(site))
    uvicorn.Config(app, http=guard.protocol_class(), ...)    # gateway/server.py gateway_server does this

uvicorn (0.3x-0.5x) closes a connection only after a response: one that never sends a full request is held
forever, and every accepted connection is a file descriptor until the process's table is full (then
accept fails, a traceback a time, and the server's own clients time out). This wraps uvicorn's HTTP
protocol class so that, per gateway:

- at most ``max_connections`` are open (also bounded by RLIMIT_NOFILE, leaving room for the process's
  own sockets and files): a new connection over the cap closes the oldest idle one (no request in
  progress), as nginx does with its keep-alive connections; when none is idle, the new one gets a 503
  with Retry-After and is closed. So accepting never stops and a flood of idle connections costs the
  flood its oldest connections, not the server its clients. A connection whose request bytes already
  wait in its socket (accepted in the same burst as a thousand others, not yet read by the loop) is not
  idle, whatever its age: evicting it would cost a client its request;
- one peer address holds at most ``max_connections_per_client`` (the same rule within its own);
- an idle connection (before its first request, or after a response) that has sent no byte of a next
  request is closed after ``keep_alive_timeout``; one that has begun a request's headers must finish
  them within ``header_timeout`` from when it became idle (a slow sender is closed, however it trickles).

Nothing here logs a line per connection: counts are kept on the guard (``evicted``, ``refused``,
``timed_out``), and a refusal is logged as a warning, which logs.RepeatFilter rate-limits.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import resource
import struct
import termios
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools is optional (uvicorn[standard]); uvicorn's http="auto" uses it when it imports
    import httptools  # noqa: F401
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors left to the process itself (ZeroMQ sockets, log files, child pipes)


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 4096
    max_connections_per_client: int = 1024
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0

    @classmethod
    def from_site(cls, site) -> "HttpLimits":
        g = site.gateway
        return cls(g.max_connections, g.max_connections_per_client, g.header_timeout, g.keep_alive_timeout)


def raise_fd_limit(ceiling: int = 1 << 20) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most ``ceiling``); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else ceiling, ceiling)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def fd_room() -> int:
    """Descriptors this process may still open, less FD_RESERVE (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    return max(16, soft - used - FD_RESERVE)


def waiting_bytes(transport) -> int:
    """Bytes the kernel holds unread for this connection (FIONREAD); 0 when it cannot tell."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def _refusal() -> bytes:
    body = json.dumps({"error": {
        "message": "this gateway holds as many connections as it may; retry after the Retry-After seconds",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


REFUSAL = _refusal()


def _base_protocol():
    """The class uvicorn's http="auto" picks: httptools' when installed, else h11's."""
    return HttpToolsProtocol or H11Protocol


class ConnectionGuard:
    """The open connections of one gateway (one uvicorn server, one event loop) and their limits."""

    def __init__(self, limits: HttpLimits, clock=time.monotonic, waiting=waiting_bytes):
        self.limits = limits
        self.waiting = waiting  # transport -> unread bytes in its socket
        self.cap = max(16, min(limits.max_connections, fd_room()))
        self.per_client = max(1, min(limits.max_connections_per_client, self.cap))
        self.clock = clock
        self.open: "OrderedDict[object, None]" = OrderedDict()  # oldest first
        self.by_client: dict[str, "OrderedDict[object, None]"] = {}
        self.evicted = self.refused = self.timed_out = 0
        self._sweeping: Optional[asyncio.TimerHandle] = None
        self._period = max(0.05, min(limits.keep_alive_timeout, limits.header_timeout) / 4)

    # ---------------------------------------------------------------- the protocol

    def protocol_class(self):
        guard, base = self, _base_protocol()

        class GuardedProtocol(base):
            _guard_idle_since = 0.0
            _guard_bytes = False  # a byte of the next request came since it became idle
            _guard_peer = ""

            def connection_made(self, transport):
                super().connection_made(transport)
                guard._opened(self, transport)

            def data_received(self, data):
                self._guard_bytes = True
                super().data_received(data)

            def on_response_complete(self):
                self._guard_idle_since, self._guard_bytes = guard.clock(), False
                super().on_response_complete()

            def connection_lost(self, exc):
                guard._closed(self)
                super().connection_lost(exc)

        return GuardedProtocol

    @staticmethod
    def idle(protocol) -> bool:
        cycle = getattr(protocol, "cycle", None)
        return cycle is None or cycle.response_complete

    def _opened(self, protocol, transport) -> None:
        protocol._guard_idle_since = self.clock()
        peer = transport.get_extra_info("peername")
        protocol._guard_peer = peer[0] if isinstance(peer, (tuple, list)) and peer else str(peer or "")
        mine = self.by_client.setdefault(protocol._guard_peer, OrderedDict())
        if len(mine) >= self.per_client and not self._evict(mine):
            return self._refuse(protocol, transport, f"peer {protocol._guard_peer} holds "
                                f"{len(mine)} connections (gateway.max_connections_per_client)")
        if len(self.open) >= self.cap and not self._evict(self.open):
            return self._refuse(protocol, transport, f"{len(self.open)} connections open (gateway.max_connections)")
        self.open[protocol] = None
        self.by_client.setdefault(protocol._guard_peer, OrderedDict())[protocol] = None  # (an eviction may drop mine)
        if self._sweeping is None:
            self._sweeping = asyncio.get_running_loop().call_later(self._period, self._sweep)

    def _refuse(self, protocol, transport, why: str) -> None:
        self.refused += 1
        log.warning("gateway refused a connection: %s", why)
        try:
            transport.write(REFUSAL)
        finally:
            transport.close()

    def _evict(self, connections: "OrderedDict[object, None]") -> bool:
        """Close the oldest idle connection of these; False when every one is serving or sending a request."""
        for protocol in connections:
            if self.idle(protocol) and not self.waiting(protocol.transport):
                self.evicted += 1
                self._forget(protocol)
                protocol.transport.close()
                return True
        return False

    def _forget(self, protocol) -> None:
        self.open.pop(protocol, None)
        mine = self.by_client.get(protocol._guard_peer)
        if mine is not None:
            mine.pop(protocol, None)
            if not mine:
                del self.by_client[protocol._guard_peer]

    def _closed(self, protocol) -> None:
        self._forget(protocol)

    def _sweep(self) -> None:
        """Close idle connections past their keep-alive or header deadline; again in a while if any are open."""
        self._sweeping = None
        now, limits = self.clock(), self.limits
        expired = [p for p in self.open if self.idle(p) and now - p._guard_idle_since >
                   (limits.header_timeout if p._guard_bytes else limits.keep_alive_timeout)]
        for protocol in expired:
            self.timed_out += 1
            self._forget(protocol)
            protocol.transport.close()
        if self.open:
            self._sweeping = asyncio.get_running_loop().call_later(self._period, self._sweep)
