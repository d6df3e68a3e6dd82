"""The gateway's connection guard (gateway/http_limits.py) on its own: the cap closes the oldest idle
connection, refuses with a 503 when every one is busy, holds one peer to its share, and the sweep closes
idle and slow connections after their timeouts. The whole door, through processes: test_serve_http_limits.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from exaserve_hpc.gateway.http_limits import ConnectionGuard, HttpLimits


class Transport:
    def __init__(self, peer: str):
        self.peer, self.closed, self.written = peer, False, b""

    def get_extra_info(self, key):
        return (self.peer, 40000) if key == "peername" else None

    def close(self):
        self.closed = True

    def write(self, data):
        self.written += data


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class Protocol:  # what the guard reads of uvicorn's: cycle, transport (hashed by identity)
    _guard_bytes = False  # the guarded protocol class's default

    def __init__(self, peer: str, busy: bool):
        self.cycle = SimpleNamespace(response_complete=False) if busy else None
        self.transport = Transport(peer)


def connect(guard: ConnectionGuard, peer: str = "127.0.0.1", busy: bool = False):
    protocol = Protocol(peer, busy)
    guard._opened(protocol, protocol.transport)
    return protocol


def test_over_the_cap_the_oldest_idle_connection_goes_and_with_none_idle_the_new_one_gets_503():
    async def run():
        guard = ConnectionGuard(HttpLimits(max_connections=16, max_connections_per_client=100))
        busy = [connect(guard, busy=True) for _ in range(8)]
        idle = [connect(guard) for _ in range(8)]
        newcomer = connect(guard)
        assert idle[0].transport.closed and not any(p.transport.closed for p in busy + idle[1:] + [newcomer])
        for p in idle[1:] + [newcomer]:
            p.cycle = SimpleNamespace(response_complete=False)  # everyone busy now
        refused = connect(guard)
        assert refused.transport.closed and refused.transport.written.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 1" in refused.transport.written
        assert (guard.evicted, guard.refused, len(guard.open)) == (1, 1, 16)
    asyncio.run(run())


def test_one_peer_is_held_to_its_share_and_others_are_untouched():
    async def run():
        guard = ConnectionGuard(HttpLimits(max_connections=64, max_connections_per_client=4))
        other = [connect(guard, "10.0.0.2") for _ in range(4)]
        flood = [connect(guard, "10.0.0.9") for _ in range(20)]
        assert not any(p.transport.closed for p in other)
        assert sum(not p.transport.closed for p in flood) == 4 and flood[-1].transport.closed is False
        assert {peer: len(c) for peer, c in guard.by_client.items()} == {"10.0.0.2": 4, "10.0.0.9": 4}
    asyncio.run(run())


def test_the_sweep_closes_idle_connections_after_keep_alive_and_slow_ones_after_the_header_timeout():
    async def run():
        clock = Clock()
        guard = ConnectionGuard(HttpLimits(header_timeout=10.0, keep_alive_timeout=5.0), clock=clock)
        idle, slow, busy = connect(guard), connect(guard), connect(guard, busy=True)
        slow._guard_bytes = True  # began its headers, never finished them
        clock.now = 6.0
        guard._sweep()
        assert idle.transport.closed and not slow.transport.closed and not busy.transport.closed
        clock.now = 11.0
        guard._sweep()
        assert slow.transport.closed and not busy.transport.closed
        assert guard.timed_out == 2
        guard._sweeping.cancel()
    asyncio.run(run())


def test_a_connection_whose_request_already_waits_in_its_socket_is_not_evicted_however_old():
    """The flood's burst: a client's connection accepted among a thousand others, its request in the
    kernel's buffer but not yet read by the loop, is not idle (it failed so under 20,000 connections)."""
    import socket

    async def run():
        guard = ConnectionGuard(HttpLimits(max_connections=16, max_connections_per_client=3))
        pairs = [socket.socketpair() for _ in range(3)]
        try:
            protocols = []
            for server_end, _ in pairs:
                protocol = connect(guard)
                protocol.transport.get_extra_info = (
                    lambda key, s=server_end, p=protocol.transport.peer: s if key == "socket" else (p, 40000))
                protocols.append(protocol)
            pairs[0][1].sendall(b"POST /v1/completions HTTP/1.1\r\n")  # the oldest has a request waiting
            newcomer = connect(guard)
            assert not protocols[0].transport.closed and protocols[1].transport.closed  # the next oldest went
            assert not newcomer.transport.closed and guard.evicted == 1
        finally:
            for a, b in pairs:
                a.close()
                b.close()
    asyncio.run(run())
