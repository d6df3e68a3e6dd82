"""Point-to-point links between the stages of a pipeline-parallel replica: one seam, two transports.

A replica of ``pp`` stages is a ring: stage k sends hidden states to stage k+1, and the last stage
sends the logits back to stage 0. Every message is (header, array): the header is a small
MessagePack-able value (what the receiver must do, the token ids, block tables), the array the
activations or logits. ``StageLink`` is the seam; an engine's stage code never knows which one it has:

- ``ZmqStageLink``: processes on different nodes, started by their nodes' agents (the CPU reference
  engine). Stage k binds a PULL socket on the address it uses to reach the controller and connects
  a PUSH socket to the next stage's PULL. With the job's CURVE keys (the agent names the job
  directory to its replicas) the PULL admits only peers holding the job's client secret.
- ``MpiStageLink``: ranks of one MPI communicator (``parallel.py`` under ``mpirun``).
- A GPU transport (NCCL send/recv of device buffers) would be a third class with the same methods.

How ZeroMQ stages find each other (the simplest scheme that needs no shared file system and no
port the controller would have to guess free): each stage binds on a free port, then says
``StageHello(key, rank, endpoint)`` to the controller (``agent/stage_process.py``), repeating it
once a second until the controller's ``StageTable`` holds every rank of that start attempt's key;
then it connects to the next rank's endpoint. A stage that never appears fails the others after
``rendezvous_timeout`` with a message naming the stage and its node; a stage whose agent reports a
failure fails them at once (the table carries the reason).

Liveness, without threads in the engine: both sockets run ZeroMQ heartbeats (a peer process that
dies closes its TCP connection at once; a lost node stops answering heartbeats within ``timeout``)
and a socket monitor reports the disconnect. A thread of the link reads only the monitors and records
the first loss in ``lost`` (and calls ``on_lost``); ``send`` and ``receive`` raise ``LinkError``
once it is set, so a stage never hangs on a peer that is gone.
"""

from __future__ import annotations

import logging
import socket as pysocket
from typing import Any, Optional, Protocol

import msgspec
import numpy as np

log = logging.getLogger("exaserve.stage_link")

POLL_SLICE_MS = 100  # how often a waiting receive looks at `lost`
# zmq.EVENT_ACCEPTED | CONNECTED | HANDSHAKE_SUCCEEDED | DISCONNECTED (zmq is imported where used)
WATCHED = 0x0020 | 0x0001 | 0x1000 | 0x0200


class LinkError(RuntimeError):
    """A peer stage is gone or did not answer in time; the message names the stage and its node."""


class StageLink(Protocol):
    """The hops of one stage: to the next stage of the ring, from the previous one."""

    def send(self, header: Any, array: np.ndarray) -> None:
        """Hand (header, array) to the next stage; LinkError if it is gone."""

    def receive(self, timeout: Optional[float] = None) -> tuple[Any, np.ndarray]:
        """The next (header, array) from the previous stage; None waits as long as the peer lives."""

    def closing(self) -> None:
        """The peers are about to leave on purpose (the ring's stop): their going is no failure."""

    def close(self) -> None:
        """Release the sockets (or nothing: MPI's communicator belongs to its caller)."""


def _pack(header: Any, array: np.ndarray) -> bytes:
    return msgspec.msgpack.encode([header, array.dtype.str, list(array.shape)])


def _unpack(meta: bytes) -> tuple[Any, np.dtype, tuple[int, ...]]:
    header, dtype, shape = msgspec.msgpack.decode(meta)
    return header, np.dtype(dtype), tuple(shape)


def stage_name(rank: int, nodes: list[str]) -> str:
    """'stage 1 on node b' (or just 'stage 1' when the node is not known)."""
    return f"stage {rank} on node {nodes[rank]}" if rank < len(nodes) and nodes[rank] else f"stage {rank}"


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): where a stage binds, so
    that it listens on the network its peers reach the controller by, never on a wildcard."""
    host = host.strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    infos = pysocket.getaddrinfo(host, 9, type=pysocket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with pysocket.socket(family, pysocket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return probe.getsockname()[0]
