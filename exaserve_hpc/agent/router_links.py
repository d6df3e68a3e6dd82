"""A replica's connections to the routers: one DEALER (identity = replica id) per router backend.

    links = RouterLinks(context, "m/r0001", ["tcp://n1:5001", "tcp://n2:5001"], keys)
    links.broadcast(hello)                # hello, stats and bye go to every router
    if links.poll(50):
        for message in links.receive(256):  # requests remember the router they came from
            ...
    links.send(chunk)                     # a request's chunks and errors go back to that router only
    links.send_chunks(chunks)             # one pass's chunks: one frame per router (TokenChunks)

Several routers share the fleet (router.count > 1): each must see every replica (the hello), its load
(the engine's queue depth and running requests in each ReplicaStats, which also keeps the replica alive
in that router's expiry) and its exit (the bye); a request's answers belong to the router that sent it.
With one router this is one socket sent to as before (a blocking send: the router is the only reader).

With several, a send never blocks: a router that is gone (its node lost) must not stall the replica
serving the others. Its pipe keeps up to LINK_HWM messages for a reconnect; past that, messages to it
are dropped (counted, logged once per router): they were answers to requests whose router is gone,
or stats a router that comes back does not need.

A router that gets stats from a replica it does not know (it expired it, or the hello was lost) answers
SayHello; the links send that router alone the hello last broadcast, and the replica goes on serving.

A router that registered after this replica started (a router rank late past placement's grace) is
named by Routers, which a router sends to each replica it knows when the fleet's routers change and in
answer to a hello that lacks one of them (router/dispatch.py): the links connect to it and say hello,
so no router is left serving a gateway with none of the replicas started before it came.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional

import zmq

from exaserve_hpc.protocol import (
    Abort, DecodeError, GenerateRequest, Message, ReplicaHello, RequestError, Routers, SayHello, TokenChunk,
    TokenChunks, decode, encode
)
from exaserve_hpc.transport import secure_client

log = logging.getLogger("exaserve.replica")

LINK_HWM = 100_000  # messages queued towards one router (several routers): a burst of chunks fits


def _chunks_frame(chunks: list[TokenChunk]) -> bytes:
    """One chunk as itself, several as one TokenChunks."""
    return encode(chunks[0] if len(chunks) == 1 else TokenChunks(chunks=chunks))


class RouterLinks:
    def __init__(self, context: zmq.Context, replica_id: str, endpoints: list[str], keys=None):
        if not endpoints:
            raise ValueError("a replica needs at least one router backend")
        self._context, self._identity, self._keys = context, replica_id.encode(), keys
        self.endpoints: list[str] = []
        self.sockets: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        self._origin: dict[str, int] = {}  # request id -> index of the router that sent it
        self._hello: Optional[ReplicaHello] = None  # as last broadcast: sent again on SayHello, and to a new router
        self.hellos_again = 0  # SayHello answered (a router had expired this replica, or missed its hello)
        self.dropped: list[int] = []  # messages a full pipe refused, per router
        for endpoint in dict.fromkeys(endpoints):  # router 0 first; a repeat would double every message
            self._open(endpoint)

    @property
    def several(self) -> bool:
        return len(self.sockets) > 1

    def _open(self, endpoint: str) -> int:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 2000)
        # Every link, router 0's too: one that starts alone may be joined by a router that registers later
        # (Routers), and from then on sends do not block (a burst of chunks must fit rather than be dropped).
        sock.setsockopt(zmq.SNDHWM, LINK_HWM)
        if self._keys is not None:  # under `exaserve launch` the routers admit only the job's key
            secure_client(sock, self._keys)
        sock.connect(endpoint)
        self.poller.register(sock, zmq.POLLIN)
        self.endpoints.append(endpoint)
        self.sockets.append(sock)
        self.dropped.append(0)
        return len(self.sockets) - 1

    def join(self, backends: list[str]) -> list[str]:
        """Link to each router in `backends` not linked yet and say hello to it (a router that registered
        after this replica started); the routers already linked are left as they are. Returns the new ones."""
        new = [b for b in dict.fromkeys(backends) if b and b not in self.endpoints]
        for endpoint in new:
            index = self._open(endpoint)
            log.info("router %s joined the fleet after this replica started: linked, hello sent", endpoint)
            if self._hello is not None:
                self._send_to(index, self._hello_frame())
        return new

    def _hello_frame(self) -> bytes:
        self._hello.routers = list(self.endpoints)  # what the routers check: does it know every one of them?
        return encode(self._hello)

    # ---------------------------------------------------------------- receiving

    def poll(self, timeout_ms: int) -> bool:
        if not self.several:
            return bool(self.sockets[0].poll(timeout_ms))
        return bool(self.poller.poll(timeout_ms))

    def receive(self, limit: int) -> Iterator[Message]:
        """What the routers have sent, at most `limit` from each (no waiting)."""
        for index, sock in enumerate(self.sockets):
            for _ in range(limit):
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    message = decode(frame)
                except DecodeError as exc:
                    log.warning("dropping an undecodable message from router %s: %s", self.endpoints[index], exc)
                    continue
                if message.__class__ is SayHello:  # answered here: only the router that asked gets it
                    if self._hello is not None:
                        self.hellos_again += 1
                        log.info("router %s asked for this replica's hello again: sent", self.endpoints[index])
                        self._send_to(index, self._hello_frame()) if self.several else sock.send(self._hello_frame())
                    continue
                if message.__class__ is Routers:  # answered here too: the links are this module's business
                    self.join(message.backends)
                    continue
                if self.several:
                    if isinstance(message, GenerateRequest):
                        self._origin[message.request_id] = index
                    elif isinstance(message, Abort):
                        self._origin.pop(message.request_id, None)
                yield message

    # ---------------------------------------------------------------- sending

    def send(self, message: Message) -> None:
        """A request's answer to the router that sent the request; anything else to every router."""
        if not self.several:
            self.sockets[0].send(encode(message))
            return
        request_id = getattr(message, "request_id", None)
        if request_id is None:
            self.broadcast(message)
            return
        index = self._origin.get(request_id, 0)
        if isinstance(message, RequestError) or (isinstance(message, TokenChunk) and message.finished):
            self._origin.pop(request_id, None)
        self._send_to(index, encode(message))

    def send_chunks(self, chunks: list[TokenChunk]) -> None:
        """Chunks of one pass of the replica's loop: one frame per router (TokenChunks where it holds more
        than one), each request's chunk to the router that sent the request."""
        if not chunks:
            return
        if not self.several:
            self.sockets[0].send(_chunks_frame(chunks))
            return
        groups: dict[int, list[TokenChunk]] = {}
        for chunk in chunks:
            index = self._origin.get(chunk.request_id, 0)
            if chunk.finished:
                self._origin.pop(chunk.request_id, None)
            groups.setdefault(index, []).append(chunk)
        for index, group in groups.items():
            self._send_to(index, _chunks_frame(group))

    def broadcast(self, message: Message) -> None:
        if message.__class__ is ReplicaHello:
            self._hello = message
            frame = self._hello_frame()
        else:
            frame = encode(message)
        if not self.several:
            self.sockets[0].send(frame)
            return
        for index in range(len(self.sockets)):
            self._send_to(index, frame)

    def _send_to(self, index: int, frame: bytes) -> None:
        try:
            self.sockets[index].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            if not self.dropped[index]:
                log.warning("router %s is not reading (gone?): dropping what this replica sends it",
                            self.endpoints[index])
            self.dropped[index] += 1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
