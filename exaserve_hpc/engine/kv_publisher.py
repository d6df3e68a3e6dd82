"""The KV-event publisher: a replica's PUB socket carrying its engine's KVEventBatch (kv_events.py) to the
router's subscriber (router/prefix_index.py), a CURVE server admitting only the run's client key.

    publisher = KVEventPublisher(kv_events_bind(router_backend), replica_id=...)
    publisher.publish(events)                          # one KVEventBatch per engine step
    announced = kv_events_announced(publisher.endpoint)  # what the replica tells the router
"""

from __future__ import annotations

import socket
import time

import zmq

from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch, encode_batch
from exaserve_hpc.transport import secure_server

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
