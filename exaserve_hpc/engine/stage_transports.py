"""The two transports of a pipeline stage's links (the seam and how stages find each other: stage_link.py).

- ``ZmqStageLink``: processes on different nodes over ZeroMQ, CURVE with the job's keys.
- ``MpiStageLink``: ranks of one MPI communicator (``parallel.py`` under ``mpirun``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from exaserve_hpc.engine.stage_link import POLL_SLICE_MS, WATCHED, LinkError, _pack, _unpack, stage_name
from exaserve_hpc.transport import CurveKeys, secure_client, secure_server

log = logging.getLogger("exaserve.stage_link")


class ZmqStageLink:
    """Stage ``rank`` of ``size`` over ZeroMQ; see the module docstring.

    Call protocol: ``link = ZmqStageLink(rank, size, nodes, host)``; publish ``link.endpoint``;
    ``link.connect(endpoint of rank + 1 mod size)``; then ``send`` / ``receive``; ``close``.
    """

    def __init__(self, rank: int, size: int, nodes: list[str], host: str = "127.0.0.1", *,
                 timeout: float = 15.0, curve=None, context=None,
                 on_lost: Optional[Callable[[str], None]] = None):

        self.rank, self.size, self.nodes, self.timeout = rank, size, list(nodes), timeout
        self.prev, self.next = (rank - 1) % size, (rank + 1) % size
        self.context = context or zmq.Context()
        self._own_context = context is None
        self.curve = curve
        self.on_lost = on_lost
        self.lost = ""  # why the link is broken, once it is
        self._zap = None
        self.inbound = self._socket(zmq.PULL)
        if curve is not None:
            # Stages are peers holding the same job client keypair: each end proves it has the secret.
            own = CurveKeys(curve.client_public, curve.client_secret, curve.client_public, curve.client_secret)
            self._zap = secure_server(self.inbound, own, self.context, "stage link")
        literal = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        if ":" in host:
            self.inbound.setsockopt(zmq.IPV6, 1)
        port = self.inbound.bind_to_random_port(f"tcp://{literal}")
        self.endpoint = f"tcp://{literal}:{port}"
        self.outbound = None
        self._monitors = [(self.inbound.get_monitor_socket(WATCHED), stage_name(self.prev, self.nodes),
                           "sending to us")]
        self._stop = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

    def _socket(self, kind):
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        ivl = max(100, int(self.timeout * 1000 / 5))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)  # a node that vanished stops answering these
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.timeout * 1000))
        return sock

    def connect(self, endpoint: str) -> None:
        """Connect to the next stage's inbound endpoint and start watching both peers."""
        self.outbound = self._socket(zmq.PUSH)
        self.outbound.setsockopt(zmq.IPV6, 1)  # the next stage may listen on an IPv6 address
        self.outbound.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer not (or no longer) connected
        self.outbound.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
        if self.curve is not None:
            c = self.curve
            secure_client(self.outbound, CurveKeys(c.client_public, b"", c.client_public, c.client_secret))
        self._monitors.append((self.outbound.get_monitor_socket(WATCHED), stage_name(self.next, self.nodes),
                               "we send to"))
        self.outbound.connect(endpoint)
        self.next_endpoint = endpoint
        self._watchdog = threading.Thread(target=self._watch, name=f"stage-link-{self.rank}", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Record the loss of a peer (the monitor sockets are this thread's). Each side has one peer: the
        connection whose handshake completed first (a handshake event names no connection, so it is the
        one accepted or made last before it); that connection closing is the peer's loss. A stranger
        without the job's key fails the handshake, so its connections come and go without counting."""

        latest = [None] * len(self._monitors)  # fd of the connection accepted / made last, per side
        peer_fd = [None] * len(self._monitors)
        poller = zmq.Poller()
        for monitor, _, _ in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set() and not self.lost:
            ready = dict(poller.poll(POLL_SLICE_MS))
            for index, (monitor, peer, role) in enumerate(self._monitors):
                if monitor not in ready:
                    continue
                message = recv_monitor_message(monitor)
                event, value = message["event"], message["value"]
                if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                    latest[index] = value
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and peer_fd[index] is None:
                    peer_fd[index] = latest[index]
                elif event == zmq.EVENT_DISCONNECTED and value == peer_fd[index]:
                    self._lose(f"{peer} ({role}) went away: its process exited or its node stopped "
                               f"answering for {self.timeout:g}s")

    def _lose(self, why: str) -> None:
        if self.lost or self._stop.is_set():
            return
        self.lost = why
        log.error("pipeline stage %d: %s", self.rank, why)
        if self.on_lost is not None:
            self.on_lost(why)

    def send(self, header: Any, array: np.ndarray) -> None:
        if self.lost:
            raise LinkError(self.lost)
        if self.outbound is None:
            raise LinkError(f"stage {self.rank} has no link to {stage_name(self.next, self.nodes)} yet")
        array = np.ascontiguousarray(array)
        try:
            self.outbound.send_multipart([_pack(header, array), memoryview(array).cast("B")], copy=True)
        except zmq.Again:
            why = (f"{stage_name(self.next, self.nodes)} did not take activations within "
                   f"{self.timeout:g}s at {self.next_endpoint}")
            self._lose(why)
            raise LinkError(why) from None

    def receive(self, timeout: Optional[float] = None) -> tuple[Any, np.ndarray]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.lost:
                raise LinkError(self.lost)
            if self.inbound.poll(POLL_SLICE_MS):
                meta, data = self.inbound.recv_multipart(copy=True)
                header, dtype, shape = _unpack(meta)
                return header, np.frombuffer(data, dtype).reshape(shape)
            if deadline is not None and time.monotonic() > deadline:
                raise LinkError(f"nothing from {stage_name(self.prev, self.nodes)} within {timeout:g}s")

    def closing(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(2)
        for sock in (self.inbound, self.outbound):
            if sock is not None:
                try:
                    sock.disable_monitor()
                except Exception:  # already closed or never monitored
                    pass
        for monitor, _, _ in self._monitors:
            monitor.close(linger=0)
        for sock in (self.inbound, self.outbound):
            if sock is not None:
                sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        if self._own_context:
            self.context.term()


class MpiStageLink:
    """The same hops between ranks of an MPI communicator (``parallel.py``).

    ``next_rank``/``prev_rank`` None: this rank sends / receives nothing on the ring (e.g. tensor
    shards other than 0 of the last stage). MPI ranks live and die together under ``mpirun``, so
    ``receive`` ignores its timeout: a lost rank ends the whole job.
    """

    HEADER_TAG, DATA_TAG = 11, 12

    def __init__(self, comm, next_rank: Optional[int], prev_rank: Optional[int]):
        self.comm, self.next_rank, self.prev_rank = comm, next_rank, prev_rank

    def send(self, header: Any, array: np.ndarray) -> None:
        from mpi4py import MPI
        array = np.ascontiguousarray(array)
        self.comm.Send([_pack(header, array), MPI.BYTE], dest=self.next_rank, tag=self.HEADER_TAG)
        self.comm.Send(array, dest=self.next_rank, tag=self.DATA_TAG)

    def receive(self, timeout: Optional[float] = None) -> tuple[Any, np.ndarray]:
        from mpi4py import MPI
        status = MPI.Status()
        self.comm.Probe(source=self.prev_rank, tag=self.HEADER_TAG, status=status)
        meta = bytearray(status.Get_count(MPI.BYTE))
        self.comm.Recv([meta, MPI.BYTE], source=self.prev_rank, tag=self.HEADER_TAG)
        header, dtype, shape = _unpack(bytes(meta))
        array = np.empty(shape, dtype)
        self.comm.Recv(array, source=self.prev_rank, tag=self.DATA_TAG)
        return header, array

    def closing(self) -> None:
        pass

    def close(self) -> None:
        pass
