"""A replica's connections to the routers: one DEALER (identity = replica id) per router backend.

    links = RouterLinks(context, "m/r0001", ["tcp://n1:5001", "tcp://n2:5001"], keys)
    links.broadcast(hello)                # hello, stats and bye go to every router
    if links.poll(50):
        for message in links.receive(256):  # requests remember the router they came from
            ...
    links.send(chunk)                     # a request's chunks and errors go back to that router only

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
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional

import zmq

from ..protocol import (
    Abort, DecodeError, GenerateRequest, Message, ReplicaHello, RequestError, SayHello, TokenChunk, decode, encode,
)

log = logging.getLogger("exaserve.replica")

LINK_HWM = 100_000  # messages queued towards one router (several routers): a burst of chunks fits


class RouterLinks:
    def __init__(self, context: zmq.Context, replica_id: str, endpoints: list[str], keys=None):
        if not endpoints:
            raise ValueError("a replica needs at least one router backend")
        self.endpoints = list(dict.fromkeys(endpoints))  # router 0 first; a repeat would double every message
        self.several = len(self.endpoints) > 1
        self.sockets: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        self._origin: dict[str, int] = {}  # request id -> index of the router that sent it
        self._hello: Optional[bytes] = None  # the replica's hello as last broadcast: sent again on SayHello
        self.hellos_again = 0  # SayHello answered (a router had expired this replica, or missed its hello)
        self.dropped = [0] * len(self.endpoints)  # messages a full pipe refused, per router
        from ..bootstrap import secure_client
        for endpoint in self.endpoints:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, replica_id.encode())
            sock.setsockopt(zmq.LINGER, 2000)
            if self.several:
                sock.setsockopt(zmq.SNDHWM, LINK_HWM)
            if keys is not None:  # under `exaserve launch` the routers admit only the job's key
                secure_client(sock, keys)
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self.sockets.append(sock)

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
                        self._send_to(index, self._hello) if self.several else sock.send(self._hello)
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

    def broadcast(self, message: Message) -> None:
        frame = encode(message)
        if message.__class__ is ReplicaHello:
            self._hello = frame
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
