"""KV-cache events: which prefix blocks a replica holds, for precise routing.

Wire format (the shape vLLM's KV-event publisher uses): each batch is one
ZeroMQ PUB multipart message ``[topic, sequence number (8 bytes, big
endian), payload]``; the payload is a MessagePack ``KVEventBatch``. Block
names are the chained hashes of ``block_manager.hash_block_tokens``, so a
router that hashes a prompt the same way knows which replica holds it.

A subscriber that missed messages sees a gap in the sequence numbers and
should drop what it knows of that replica (``AllBlocksCleared`` is also sent
when the engine shuts down).

Call protocol: ``pub = KVEventPublisher(endpoint, topic, with_tokens=...)``;
``pub.publish(events)`` after each engine step (no-op for an empty list;
never blocks: a slow subscriber loses messages, the engine never waits);
``pub.close()``. ``decode_batch(payload)`` for subscribers.

Privacy: a replica's publishers are CURVE servers (``secure_publishers``, set
by the replica process before its engine is built, from the run's keys): each
replica makes its own key pair, announces the public key in its hello (over
the router's CURVE backend), and its ZAP handler admits only the run's client
key, which the router holds. A subscriber without that key completes no
handshake and receives nothing. The block hashes are keyed with the run's
secret salt (``block_manager.set_block_hash_salt``).
"""

from __future__ import annotations

import socket
import time
from typing import Union

import msgspec
import zmq

from exaserve_hpc.transport import secure_server


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    block_hashes: list[int]          # consecutive blocks of one sequence, in order
    parent_block_hash: int | None    # hash of the block before the first; None at the start
    token_ids: list[int]             # len(block_hashes) * block_size ids; [] from a publisher that withholds
    #                                  prompts (replicas do, CURVE or not: the router needs only hashes)
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[int]          # evicted: no longer reusable on this replica


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, frozen=True):
    ts: float                        # publisher's wall clock, seconds since the epoch
    events: list[KVEvent]
    replica_id: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError for a payload that is not a KVEventBatch."""
    return _DECODER.decode(payload)


_PUBLISHER_CURVE = None  # transport.CurveKeys for every publisher of this process (secure_publishers)


def secure_publishers(keys) -> None:
    """Make every KVEventPublisher created after this in this process a CURVE server.

    ``keys``: a ``transport.CurveKeys`` whose server pair is the publisher's (the replica's own) and whose
    ``client_public`` is the only subscriber key admitted (the run's client key, the router's); None: plain
    sockets again. Engines create their publisher themselves, so the replica sets this before building one."""
    global _PUBLISHER_CURVE
    _PUBLISHER_CURVE = keys


def publisher_curve():
    """The keys publishers of this process use (None: plain)."""
    return _PUBLISHER_CURVE


_DEFAULT = object()


class KVEventPublisher:
    """Binds a PUB socket on ``endpoint`` (e.g. ``tcp://*:5557``).

    ``curve``: transport.CurveKeys making it a CURVE server that admits only ``curve.client_public``;
    default: this process's (``secure_publishers``), None: plain."""

    def __init__(self, endpoint: str, topic: str = "kv-events", replica_id: str = "",
                 high_water_mark: int = 100_000, with_tokens: bool = True, curve=_DEFAULT) -> None:

        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.setsockopt(zmq.LINGER, 0)
        if "[" in endpoint:  # an IPv6 address
            self._socket.setsockopt(zmq.IPV6, 1)
        curve = _PUBLISHER_CURVE if curve is _DEFAULT else curve
        self._zap = None
        self.server_public_key = ""  # Z85; "" when plain
        if curve is not None:
            self._zap = secure_server(self._socket, curve, self._context, "kv events")
            self.server_public_key = curve.server_public.decode()
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            if self._zap is not None:
                self._zap.stop()
            raise ValueError(f"cannot bind the KV-event socket on {endpoint!r}: {e}; "
                             "choose a free port or another endpoint") from e
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._replica_id = replica_id
        self._seq = 0
        self.dropped = 0
        self._with_tokens = with_tokens  # False: BlockStored goes out with token_ids=[] (hashes only)

    def publish(self, events: list[KVEvent]) -> None:
        if not events or self._socket is None:
            return
        if not self._with_tokens:
            events = [BlockStored(e.block_hashes, e.parent_block_hash, [], e.block_size)
                      if isinstance(e, BlockStored) else e for e in events]
        payload = encode_batch(KVEventBatch(ts=time.time(), events=list(events),
                                            replica_id=self._replica_id))
        frames = [self._topic, self._seq.to_bytes(8, "big"), payload]
        self._seq += 1
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        if self._socket is not None:
            self.publish([AllBlocksCleared()])
            self._socket.close()
            self._socket = None
            if self._zap is not None:
                self._zap.stop()
                self._zap = None


def kv_events_bind(router_backend: str) -> str:
    """Where the engine's KV-event PUB binds: loopback beside a loopback router, else every interface."""
    host = router_backend.rpartition(":")[0].removeprefix("tcp://").strip("[]")
    if host == "::1":
        return "tcp://[::1]:*"
    if host == "localhost" or host.startswith("127."):
        return f"tcp://{'127.0.0.1' if host == 'localhost' else host}:*"  # an address: bind takes no host name
    return "tcp://*:*"


def kv_events_announced(bound: str) -> str:
    """The endpoint to announce: a wildcard bind is published under this node's name (as the router does)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:"):
        if bound.startswith(wildcard):
            return f"tcp://{socket.getfqdn()}:{bound[len(wildcard):]}"
    return bound
