"""The ZeroMQ edge of the router: two ROUTER sockets and one thread.

frontend (bind): gateways and native clients connect DEALER sockets.
backend  (bind): replicas connect DEALER sockets whose identity is their replica id.
kv events (SUB, connects): when the routing policy follows KV events
  (router.prefix_mode: precise), to each replica whose hello names a KV-event
  endpoint (engine/kv_events.py); a gap in a replica's sequence numbers makes
  the router forget what it knew of it.

With `curve` (transport.CurveKeys, under `exaserve launch`) frontend and
backend are CURVE servers that admit only the job's client key (ZAP): the
router listens on every interface there, and a stranger must neither register
as a replica (and read prompts) nor send requests past the gateway's API keys.
The KV-event SUB is then a CURVE client with the job's client key: each
replica's PUB is a CURVE server with a key pair of its own, whose public key
its hello (over the CURVE backend) announces, and it admits only that client
key, so no other local user can subscribe. A replica that announces KV events
without a key is not followed by a CURVE router. The SUB only connects to
endpoints an admitted replica named.

The thread polls both sockets with a short timeout, hands every decoded
message to the transport-free `Dispatcher`, sends what it returns, and runs
`Dispatcher.tick` for expiries (Paranoid Pirate style).

Token chunks travel batched where both ends can: a replica sends one pass's chunks as one TokenChunks
frame, and a gateway whose requests set batch_replies (the gateway's RouterClient does) gets the chunks
of one burst of incoming messages as one TokenChunks frame, in order with its other replies. A frame
costs the thread about as much as routing the chunk inside it (docs/benchmarks.md: router CPU). Other frontend
peers (native clients, tests) get one TokenChunk a frame, as before.

Backpressure towards a gateway: a reply its connection cannot take now
(EAGAIN: its pipe is at the high-water mark, the gateway's loop is behind) is
never dropped. It waits in that gateway's backlog, with every later reply to
that gateway behind it (order kept), and the backlog is flushed as the pipe
drains, on every pass of the loop (1 ms polls while anything waits). A backlog
holds at most `gateway_backlog` messages; past that, the request of the reply
that did not fit is failed alone: its waiting chunks are taken out, its
replica told to abort, and one RequestError (503 gateway_backlog) queued in
their place, so its client gets an error instead of waiting for a final chunk
that never comes. Other threads talk to
it only through `call()`, which queues a function to run on the router thread,
so the dispatcher is never touched by two threads.
"""

from __future__ import annotations

import logging
import socket as pysocket
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional, TypeVar, Union

import msgspec
import zmq

from exaserve_hpc.engine.kv_events import AllBlocksCleared, decode_batch
from exaserve_hpc.peer_guard import PeerGuard
from exaserve_hpc.protocol import Abort, DecodeError, Message, ReplicaHello, RequestError, TokenChunk, TokenChunks
from exaserve_hpc.router.dispatch import GATEWAY, Dispatcher, Outgoing, RoutedRequest
from exaserve_hpc.transport import secure_server

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_MS = 50
SEND_BATCH = 64  # replies held back at most while a burst of incoming messages is handled
GATEWAY_HWM = 10_000  # replies queued in libzmq per gateway connection before EAGAIN (its default: 1,000)
GATEWAY_BACKLOG = 200_000  # replies held by us per gateway beyond that; then one request is failed
BACKLOG_POLL_MS = 1  # poll timeout while a backlog waits to be flushed
SNAPSHOT_SHARE = 0.02  # of the router thread's time at most spent on status snapshots
# The largest message a peer may send (ZMQ_MAXMSGSIZE): a gateway's request for a 1M-token prompt packs its ids
# and block hashes into about 4.3 MB; a larger message drops the sender's connection before it is read.
MAX_MESSAGE_BYTES = 64 << 20

# The hot path calls the Cython socket methods with int flags: pyzmq's sugar
# (send_multipart, enum flags) costs about 3 us a message, as much as the routing.
_send_frame = zmq.backend.Socket.send
_recv_frame = zmq.backend.Socket.recv
_sockopt = zmq.backend.Socket.get
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
# Gateways' messages: a request's prompt stays encoded (RoutedRequest) and goes on to the replica in
# the gateway's bytes; decoding and re-encoding 1,000 token ids was half the thread's time a request.
_frontend_decoder = msgspec.msgpack.Decoder(Union[RoutedRequest, Abort])
# protocol.decode/encode without their Python frames (a call each way per message on this thread).
_backend_decode = msgspec.msgpack.Decoder(Message).decode
_encode = msgspec.msgpack.Encoder().encode
_PRE_ENCODED = (memoryview, bytes)


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def bind(socket: zmq.Socket, host: str, port: int) -> str:
    """Bind to host:port (0: any free port) and return the endpoint peers connect to: a wildcard
    host is published under this node's name, which other nodes resolve (they cannot connect to 0.0.0.0)."""
    if port:
        socket.bind(f"tcp://{host}:{port}")
    else:
        port = int(socket.bind_to_random_port(f"tcp://{host}"))
    return f"tcp://{pysocket.getfqdn() if host in WILDCARD_HOSTS else host}:{port}"


class ZmqRouter:
    def __init__(self, dispatcher: Dispatcher, host: str = "127.0.0.1", frontend_port: int = 0,
                 backend_port: int = 0, context: Optional[zmq.Context] = None,
                 clock: Callable[[], float] = time.monotonic, curve=None, gateway_hwm: int = GATEWAY_HWM,
                 gateway_backlog: int = GATEWAY_BACKLOG):
        self.dispatcher = dispatcher
        self.clock = clock
        self.context = context or zmq.Context.instance()
        self.frontend = self.context.socket(zmq.ROUTER)
        self.backend = self.context.socket(zmq.ROUTER)
        for sock in (self.frontend, self.backend):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable peer raises instead of vanishing
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger one drops its connection unread
        # Malformed messages are counted per peer; past a limit the peer is refused a while (dropped unread),
        # and each kind is logged once per peer (peer_guard.py): 20,000 bad frames cost a counter, not the log.
        self.peers = PeerGuard()
        self._refused: frozenset = frozenset()  # peers refused now; refreshed each tick and on a refusal
        self.frontend.setsockopt(zmq.SNDHWM, gateway_hwm)  # before bind: connections take it when they come
        self.gateway_backlog = gateway_backlog
        self._backlogs: dict[bytes, deque] = {}  # gateway identity -> replies waiting for room, oldest first
        self._batched_peers: set[bytes] = set()  # gateways whose requests said batch_replies: sent TokenChunks
        # Token chunks and the frames that carried them, from replicas and to gateways (snapshot, /metrics):
        # chunks a frame is what batching saves (a frame costs the thread about as much as a chunk in it).
        self.chunks_in = self.chunk_frames_in = self.chunks_out = self.chunk_frames_out = 0
        # Requests failed for a full backlog: replies for them still in the batch being sent are dropped
        # (the dispatcher forgot them, so no others come); forgotten once that gateway's backlog is flushed.
        self._failed_for_backlog: set[str] = set()
        self.backlog_counters = {"backlogged": 0, "failed_for_backlog": 0, "dropped_gateway_gone": 0}
        self._zap = []  # leases on the context's ZAP authenticator, stopped after the sockets close
        self._curve = curve  # its client pair subscribes to the replicas' CURVE KV-event publishers
        if curve is not None:
            self._zap = [secure_server(self.frontend, curve, self.context, "router frontend"),
                         secure_server(self.backend, curve, self.context, "router backend")]
        self.frontend_endpoint = bind(self.frontend, host, frontend_port)
        self.backend_endpoint = bind(self.backend, host, backend_port)
        # deque: append and popleft are atomic, and an empty one costs the loop a truth test where
        # queue.Queue.get_nowait raised Empty (a lock and an exception) on every pass.
        self._calls: "deque[tuple[Callable[[], object], Future]]" = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-router", daemon=True)
        self._snapshot: dict = dispatcher.snapshot()
        self._snapshot_lock = threading.Lock()
        self.messages_routed = 0
        self._poller = zmq.Poller()
        self.kv_events: Optional[zmq.Socket] = None  # SUB, created at the first replica that publishes
        self._kv_seq: dict[str, int] = {}

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "ZmqRouter":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for sock in (self.frontend, self.backend, self.kv_events):
            if sock is not None:
                sock.close(linger=0)
        for lease in self._zap:
            lease.stop()

    # ---------------------------------------------------------------- other threads

    def call(self, fn: Callable[[Dispatcher], T]) -> "Future[T]":
        """Run fn(dispatcher) on the router thread; its returned Outgoing list (if any) is sent."""
        future: Future = Future()
        self._calls.append((lambda: fn(self.dispatcher), future))
        return future

    def replica_lost(self, replica_id: str, cause: str) -> None:
        self.call(lambda d: d.replica_lost(replica_id, cause, self.clock()))

    def drain(self, replica_id: str) -> None:
        self.call(lambda d: d.drain(replica_id))

    def snapshot(self) -> dict:
        with self._snapshot_lock:
            return dict(self._snapshot)

    # ---------------------------------------------------------------- router thread

    def _run(self) -> None:
        poller = self._poller
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        next_tick = next_snapshot = 0.0
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(BACKLOG_POLL_MS if self._backlogs else POLL_MS))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if self.frontend in events:
                self._drain_socket(self.frontend, self._on_frontend)
            if self.backend in events:
                self._drain_socket(self.backend, self._on_backend)
            if self.kv_events is not None and self.kv_events in events:
                self._drain_kv_events()
            if self._calls:
                self._run_calls()
            if self._backlogs:
                self._flush_backlogs()
            now = self.clock()
            if now >= next_tick:
                self._send(self.dispatcher.tick(now))
                if self._refused:
                    self._refused = self.peers.refused_now(now)
                next_tick = now + POLL_MS / 1000
                if now >= next_snapshot:
                    self._publish_snapshot()
                    # A snapshot of 3,072 replicas takes ~10 ms: taken every tick it was most of the
                    # thread's time. At most SNAPSHOT_SHARE of the thread goes to it, at least one a tick.
                    next_snapshot = now + max(POLL_MS / 1000, (self.clock() - now) / SNAPSHOT_SHARE)

    # ---------------------------------------------------------------- RouterPort (router/port.py)

    @property
    def backend_endpoints(self) -> list[str]:
        return [self.backend_endpoint]

    def routing(self) -> bool:
        """False once its thread ran and ended (a thread not started yet is not a stopped one)."""
        return self._thread.ident is None or self._thread.is_alive()

    def _bad(self, peer: bytes, kind: str, detail: str) -> None:
        now = self.clock()
        line = self.peers.bad(bytes(peer), kind, detail, now)
        if line:
            log.warning("router: %s", line)
            self._refused = self.peers.refused_now(now)

    def _publish_snapshot(self) -> None:
        snapshot = self.dispatcher.snapshot()
        # Backpressure towards the gateways: replies waiting now, and the counts since start.
        snapshot["peer_guard"] = self.peers.status(self.clock())
        snapshot["gateway_backlog"] = {"waiting": sum(map(len, self._backlogs.values())), **self.backlog_counters}
        snapshot.update(chunks_from_replicas=self.chunks_in, chunk_frames_from_replicas=self.chunk_frames_in,
                        chunks_to_gateways=self.chunks_out, chunk_frames_to_gateways=self.chunk_frames_out)
        # Seconds since each replica last spoke (any message): the controller counts them as its node's life
        # (controller/liveness.py), so a node whose agent is starved but whose replicas stream is not lost.
        now = self.clock()
        snapshot["replica_silent_s"] = {rid: round(now - e.last_seen, 3) for rid, e in self.dispatcher.replicas.items()}
        with self._snapshot_lock:
            self._snapshot = snapshot

    def _drain_socket(self, sock: zmq.Socket, handler: Callable[[bytes, memoryview], list[Outgoing]]) -> None:
        # Replies are sent in batches of up to SEND_BATCH messages rather than one by one:
        # libzmq wakes its I/O thread (a write(2) on an eventfd) whenever a pipe goes from
        # empty to non-empty, and back-to-back sends find it still awake. Profiled: those
        # writes were a fifth of the router thread's time when every reply was sent at once.
        out: list[Outgoing] = []
        try:
            for _ in range(1000):  # bounded, so one busy side cannot starve the other
                try:
                    peer = _recv_frame(sock, _NOBLOCK)
                except zmq.Again:
                    return
                # A ROUTER socket always delivers the identity with at least one frame behind it.
                # The payload comes as a Frame: its `more` flag is a C attribute, where
                # get(RCVMORE) builds a SocketOption enum in Python (~0.7 us a message, profiled).
                frame = _recv_frame(sock, _NOBLOCK, False)
                if frame.more:
                    frames = 2
                    while _sockopt(sock, _RCVMORE):  # the rest of a multipart message is already here
                        _recv_frame(sock, _NOBLOCK)
                        frames += 1
                    if self._refused and peer in self._refused:
                        self.peers.dropped += 1
                    else:
                        self._bad(peer, "multipart", f"{frames} frames (expected identity + payload)")
                    continue
                if self._refused and peer in self._refused:
                    self.peers.dropped += 1
                    continue
                try:
                    out += handler(peer, frame.buffer)
                except DecodeError as exc:
                    self._bad(peer, "undecodable", str(exc))
                except Exception:  # a bug in one message must not stop the router serving the others
                    log.exception("router failed on a message from %r", peer[:32])
                self.messages_routed += 1
                if len(out) >= SEND_BATCH:
                    self._send_all(out)
                    out = []
        finally:
            if out:
                self._send_all(out)

    def _send_all(self, outgoing: list[Outgoing]) -> None:
        try:
            self._send(outgoing)
        except Exception:  # as for a message's handler: one bad reply must not stop the router
            log.exception("router failed sending %d message(s)", len(outgoing))

    def _on_frontend(self, peer: bytes, payload: memoryview) -> list[Outgoing]:
        message = _frontend_decoder.decode(payload)
        if message.__class__ is RoutedRequest:
            if message.batch_replies:
                self._batched_peers.add(peer)
            return self.dispatcher.on_request(peer, message, self.clock(), payload)
        if isinstance(message, Abort):
            return self.dispatcher.on_abort(message.request_id)
        log.warning("unexpected %s on the router frontend", type(message).__name__)
        return []

    def _on_backend(self, peer: bytes, payload: memoryview) -> list[Outgoing]:
        message = _backend_decode(payload)
        replica_id = peer.decode(errors="replace")
        if message.__class__ is TokenChunks:  # most of what replicas send: straight to its handler
            self.chunk_frames_in += 1
            self.chunks_in += len(message.chunks)
            return self.dispatcher.on_chunks(replica_id, message.chunks, self.clock())
        if message.__class__ is TokenChunk:
            self.chunk_frames_in += 1
            self.chunks_in += 1
            return self.dispatcher.on_chunk(replica_id, message, self.clock())
        if isinstance(message, ReplicaHello) and message.kv_events_endpoint and self.dispatcher.follows_kv_events:
            self._subscribe_kv_events(replica_id, message.kv_events_endpoint, message.kv_events_key)
        return self.dispatcher.on_replica_message(replica_id, message, self.clock())

    # ---------------------------------------------------------------- KV events (precise prefix routing)

    def _subscribe_kv_events(self, replica_id: str, endpoint: str, server_key: str = "") -> None:
        curve = self._curve
        if (curve is None) != (not server_key):
            log.warning("not following the KV events of replica %s at %s: %s", replica_id, endpoint,
                        "it announced no CURVE key, and this router admits only CURVE peers" if curve is not None
                        else "they are CURVE-protected and this router has no keys")
            return
        if self.kv_events is None:
            self.kv_events = self.context.socket(zmq.SUB)
            self.kv_events.setsockopt(zmq.LINGER, 0)
            self.kv_events.setsockopt(zmq.SUBSCRIBE, b"")
            self.kv_events.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if curve is not None:  # one client pair (the job's) for every publisher
                self.kv_events.curve_publickey = curve.client_public
                self.kv_events.curve_secretkey = curve.client_secret
            self._poller.register(self.kv_events, zmq.POLLIN)
        try:
            if curve is not None:  # taken by this connection only (libzmq copies the options at connect)
                self.kv_events.curve_serverkey = server_key.encode()
            self.kv_events.connect(endpoint)
        except (zmq.ZMQError, ValueError, UnicodeError) as exc:
            log.warning("not following the KV events of replica %s at %s: %s", replica_id, endpoint, exc)
            return
        self._kv_seq.pop(replica_id, None)
        log.info("following KV events of replica %s at %s%s", replica_id, endpoint,
                 f" (CURVE server key {server_key})" if server_key else "")

    def _drain_kv_events(self) -> None:
        for _ in range(1000):
            try:
                frames = self.kv_events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                _topic, seq_frame, payload = frames
                batch = decode_batch(payload)
            except (ValueError, *DecodeError) as exc:
                log.warning("dropping an undecodable KV-event message: %s", exc)
                continue
            seq = int.from_bytes(seq_frame, "big")
            events = list(batch.events)
            last = self._kv_seq.get(batch.replica_id)
            if last is not None and seq != last + 1:
                # Missed messages: what we knew of this replica may be wrong; start over from here.
                events.insert(0, AllBlocksCleared())
            self._kv_seq[batch.replica_id] = seq
            self.dispatcher.on_kv_events(batch.replica_id, events)

    def _run_calls(self) -> None:
        calls = self._calls
        while calls:
            fn, future = calls.popleft()
            try:
                result = fn()
                if isinstance(result, list) and all(isinstance(o, Outgoing) for o in result):
                    self._send(result)
                future.set_result(result)
            except Exception as exc:
                future.set_exception(exc)

    def _send(self, outgoing: list[Outgoing]) -> None:
        batches: Optional[dict[bytes, list[TokenChunk]]] = None  # per gateway that reads TokenChunks
        batched_peers, backlogs = self._batched_peers, self._backlogs
        last_peer, last_batch = None, None  # a replica's chunks mostly go to one gateway: its list at hand
        for out in outgoing:
            if out.side == GATEWAY:
                peer = out.peer
                if out.message.__class__ is TokenChunk:
                    if peer is last_peer:
                        last_batch.append(out.message)
                        continue
                    if peer in batched_peers and peer not in backlogs:
                        if batches is None:
                            batches = {}
                        last_peer, last_batch = peer, batches.setdefault(peer, [])
                        last_batch.append(out.message)
                        continue
                last_peer = None
                if batches and peer in batches:  # its chunks so far go first: a gateway's replies stay in order
                    self._chunks_to_gateway(peer, batches.pop(peer))
                backlog = self._backlogs.get(peer)
                if backlog is not None:  # behind what already waits: a stream's chunks stay in order
                    self._hold(peer, backlog, out.message)
                else:
                    self._to_gateway(peer, out.message)
                continue
            message = out.message
            try:
                _send_frame(self.backend, out.peer, _MORE_NOBLOCK)
                _send_frame(self.backend, message if message.__class__ in _PRE_ENCODED else _encode(message), _NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    # The replica's socket is gone: move its requests now rather than at expiry.
                    replica_id = out.peer.decode(errors="replace")
                    self._send(self.dispatcher.replica_lost(replica_id, "unreachable", self.clock()))
                    continue
                log.warning("cannot send %s to replica %r: %s", type(out.message).__name__, out.peer[:32], exc)
        if batches:
            for peer, chunks in batches.items():
                self._chunks_to_gateway(peer, chunks)

    # ---------------------------------------------------------------- backpressure towards gateways

    def _to_gateway(self, peer: bytes, message) -> bool:
        """Send one reply now; False when the gateway's pipe is full (the caller keeps it)."""
        try:
            _send_frame(self.frontend, peer, _MORE_NOBLOCK)
        except zmq.Again:
            self._hold(peer, self._backlogs.setdefault(peer, deque()), message)
            return False
        except zmq.ZMQError as exc:
            self._gateway_gone(peer, message, exc)
            return True
        # The identity frame went, so the payload goes too: libzmq takes a multipart message whole.
        _send_frame(self.frontend, _encode(message), _NOBLOCK)
        if message.__class__ is TokenChunk:
            self.chunk_frames_out += 1
            self.chunks_out += 1
        return True

    def _chunks_to_gateway(self, peer: bytes, chunks: list[TokenChunk]) -> None:
        """Chunks for one gateway that reads TokenChunks: one frame; held one by one if its pipe is full."""
        if len(chunks) == 1:
            self._to_gateway(peer, chunks[0])
            return
        try:
            _send_frame(self.frontend, peer, _MORE_NOBLOCK)
        except zmq.Again:
            backlog = self._backlogs.setdefault(peer, deque())
            for chunk in chunks:
                self._hold(peer, backlog, chunk)
            return
        except zmq.ZMQError as exc:
            self._gateway_gone(peer, chunks[0], exc, len(chunks))
            return
        _send_frame(self.frontend, _encode(TokenChunks(chunks=chunks)), _NOBLOCK)
        self.chunk_frames_out += 1
        self.chunks_out += len(chunks)

    def _hold(self, peer: bytes, backlog: deque, message) -> None:
        if message.request_id in self._failed_for_backlog:
            return  # its RequestError already waits in the backlog: it must stay the last word
        if not backlog:
            log.warning("gateway %r is not keeping up: holding its replies until it reads", peer[:32])
        if len(backlog) >= self.gateway_backlog and not isinstance(message, RequestError):
            self._fail_for_backlog(peer, backlog, message.request_id)
            return
        backlog.append(message)
        self.backlog_counters["backlogged"] += 1

    def _fail_for_backlog(self, peer: bytes, backlog: deque, request_id: str) -> None:
        """The backlog is full: fail this one request cleanly rather than drop any reply."""
        kept = [m for m in backlog if m.request_id != request_id]
        backlog.clear()
        backlog.extend(kept)
        self._failed_for_backlog.add(request_id)
        self.backlog_counters["failed_for_backlog"] += 1
        log.warning("gateway %r: %d replies waiting; failing request %s", peer[:32], len(backlog), request_id,
                    extra={"request_id": request_id})
        self._send(self.dispatcher.on_abort(request_id))  # the replica stops; nothing more comes for it
        backlog.append(RequestError(
            request_id=request_id, status=503, code="gateway_backlog", retry_after=1.0,
            message=f"the gateway fell {self.gateway_backlog} replies behind the router; request {request_id} "
                    "was stopped so the others could go on; retry it"))

    def _flush_backlogs(self) -> None:
        for peer, backlog in list(self._backlogs.items()):
            while backlog:
                message = backlog[0]
                try:
                    _send_frame(self.frontend, peer, _MORE_NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:  # gone: what waits for it has no reader left
                    self._gateway_gone(peer, message, exc, len(backlog))
                    backlog.clear()
                    break
                _send_frame(self.frontend, _encode(message), _NOBLOCK)
                backlog.popleft()
                if message.__class__ is TokenChunk:
                    self.chunk_frames_out += 1
                    self.chunks_out += 1
            if not backlog:
                del self._backlogs[peer]
                if not self._backlogs:
                    self._failed_for_backlog.clear()
                log.info("gateway %r caught up", peer[:32])

    def _gateway_gone(self, peer: bytes, message, exc: zmq.ZMQError, count: int = 1) -> None:
        # A gateway that went away (EHOSTUNREACH) is not an error of ours: nobody is left to read this.
        self.backlog_counters["dropped_gateway_gone"] += count
        self._batched_peers.discard(peer)
        log.warning("cannot send %d message(s) (%s) to gateway %r: %s", count, type(message).__name__, peer[:32], exc)
