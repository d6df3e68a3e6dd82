"""What a ZeroMQ service (the controller, the router) does with messages it cannot use: a pure policy, no
sockets, the clock passed in.

Every message is handled under a guard: one that does not decode, or that its handler refuses, is dropped
and counted against the peer (the ZeroMQ identity) that sent it. The first bad message of each kind from a
peer is logged; past `limit` bad messages within `window` seconds the peer is refused for `refuse_for`
seconds (its messages are dropped unread), so a broken or hostile peer costs the service a counter and
one log line, never its thread or its disk. What the controller checks beyond decoding:
controller/message_checks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MAX_SHOWN = 120  # characters of a bad value shown in a log line


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class _Peer:
    bad: list[float] = field(default_factory=list)  # times of recent bad messages
    kinds: set[str] = field(default_factory=set)  # kinds already logged
    refused_until: float = 0.0
    total: int = 0


class PeerGuard:
    def __init__(self, limit: int = 10, window: float = 60.0, refuse_for: float = 60.0, max_peers: int = 4096):
        self.limit, self.window, self.refuse_for, self.max_peers = limit, window, refuse_for, max_peers
        self._peers: dict[bytes, _Peer] = {}
        self.dropped = 0  # every message dropped, bad or from a refused peer (status shows it)

    def refused(self, peer: bytes, now: float) -> bool:
        """True while `peer` is refused (its message is dropped unread)."""
        state = self._peers.get(peer)
        if state is not None and now < state.refused_until:
            self.dropped += 1
            return True
        return False

    def bad(self, peer: bytes, kind: str, detail: str, now: float) -> Optional[str]:
        """Count one bad message of `kind` (e.g. "AgentHeartbeat: ValueError") from `peer`; the line to log
        (with `detail`), or None when a message of that kind from that peer was logged before."""
        self.dropped += 1
        state = self._peers.get(peer)
        if state is None:
            if len(self._peers) >= self.max_peers:  # identities are cheap: forget the quietest, stay bounded
                self._peers.pop(min(self._peers, key=lambda p: self._peers[p].bad[-1] if self._peers[p].bad else 0))
            state = self._peers[peer] = _Peer()
        state.total += 1
        state.bad = [t for t in state.bad if now - t < self.window] + [now]
        if len(state.bad) > self.limit:
            state.refused_until, state.bad = now + self.refuse_for, []
            return (f"refusing peer {peer[:32]!r} for {self.refuse_for:g}s: more than {self.limit} bad messages "
                    f"in {self.window:g}s ({state.total} in all)")
        if kind in state.kinds or len(state.kinds) >= 32:
            return None
        state.kinds.add(kind)
        return f"dropped a bad message from peer {peer[:32]!r} ({kind}): {shorten(detail, 300)}"

    def refused_now(self, now: float) -> frozenset:
        """The peers refused at `now` (a service may keep this set and test membership per message)."""
        return frozenset(p for p, s in self._peers.items() if now < s.refused_until)

    def status(self, now: float) -> dict:
        return {"dropped_messages": self.dropped,
                "refused_peers": sorted(p[:32].decode(errors="replace") for p, s in self._peers.items()
                                        if now < s.refused_until)}
