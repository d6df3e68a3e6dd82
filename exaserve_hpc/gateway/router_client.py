"""The gateway's side of the router: a GatewayBackend over one ZeroMQ DEALER socket.

One asyncio task reads every reply and hands it to the queue of the request
it belongs to; `stream()` sends a GenerateRequest and yields that request's
chunks. Closing the stream early (client gone, stop string matched) sends an
Abort so the replica stops spending work on it. With `curve` (the job's
transport.CurveKeys) the socket is a CURVE client of the router's frontend.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from exaserve_hpc.gateway.backend import BackendError, ModelInfo
from exaserve_hpc.protocol import (
    Abort, DecodeError, GenerateRequest, RequestError, TokenChunk, TokenChunks, decode, encode, pack_request
)
from exaserve_hpc.transport import secure_client

log = logging.getLogger(__name__)

_SILENT = object()  # queued for a stream that heard nothing from the router for reply_timeout


class RouterClient:
    def __init__(self, endpoint: str, models: list[ModelInfo],
                 status: Callable[[], dict] = dict, ready: Callable[[], bool] = lambda: True,
                 reply_timeout: float = 600.0, curve=None):
        self.endpoint = endpoint
        self.curve = curve
        self._models = models
        self._status = status
        self._ready = ready
        self.reply_timeout = reply_timeout
        self._context: Optional[zmq.asyncio.Context] = None
        self._socket: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._watcher: Optional[asyncio.Task] = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._heard: dict[str, float] = {}  # request id -> loop time of its last reply (or of its send)

    # ---------------------------------------------------------------- GatewayBackend

    def models(self) -> list[ModelInfo]:
        return list(self._models)

    def status(self) -> dict:
        return self._status()

    def ready(self) -> bool:
        return self._ready()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self._ensure_started()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._heard[request.request_id] = asyncio.get_running_loop().time()
        finished = False
        try:
            # Prompt and hashes as two bins; replies may come batched (TokenChunks), which _read_replies takes.
            await self._socket.send(encode(msgspec.structs.replace(pack_request(request), batch_replies=True)))
            while True:
                # No timeout around the wait (asyncio.wait_for before Python 3.12 swallows a cancellation
                # that meets a reply already queued, so a client's hang-up was lost: issue 13 item 10; and
                # asyncio.timeout's timer a chunk was a fifth of the gateway's streaming CPU, profiled):
                # _watch_silence queues _SILENT for a stream the router left silent for reply_timeout.
                message = await queue.get()
                if message is _SILENT:
                    raise BackendError(504, "router_timeout",
                                       f"no reply from the router for {self.reply_timeout:.0f}s", 1.0)
                if isinstance(message, RequestError):
                    finished = True
                    raise BackendError(message.status, message.code, message.message, message.retry_after)
                finished = message.finished  # before the yield: the consumer may close us right after it
                yield message
                if finished:
                    return
        finally:
            self._queues.pop(request.request_id, None)
            self._heard.pop(request.request_id, None)
            if not finished and self._socket is not None and not self._socket.closed:
                # The gateway closes streams inside a shielded scope, so this send survives a disconnect.
                await self._socket.send(encode(Abort(request_id=request.request_id)))

    # ---------------------------------------------------------------- plumbing

    def _ensure_started(self) -> None:
        if self._socket is not None:
            return
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # As deep as the router's send side (zmq_router.GATEWAY_HWM): bursts wait in libzmq, not in its backlog.
        self._socket.setsockopt(zmq.RCVHWM, 10_000)
        if self.curve is not None:
            secure_client(self._socket, self.curve)
        self._socket.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_replies())
        self._watcher = loop.create_task(self._watch_silence())

    async def _read_replies(self) -> None:
        loop, heard, queues = asyncio.get_running_loop(), self._heard, self._queues
        while True:
            frame = await self._socket.recv()
            try:
                message = decode(frame)
            except DecodeError as exc:
                log.warning("undecodable reply from the router: %s", exc)
                continue
            now = loop.time()
            for reply in message.chunks if message.__class__ is TokenChunks else (message,):
                rid = getattr(reply, "request_id", "")
                queue = queues.get(rid)
                if queue is not None:
                    heard[rid] = now
                    queue.put_nowait(reply)

    async def _watch_silence(self) -> None:
        """One timer for every stream: a stream the router left silent for reply_timeout gets _SILENT
        (a 504 router_timeout), within a quarter of reply_timeout (at most a second) after it."""
        loop = asyncio.get_running_loop()
        period = min(1.0, self.reply_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for rid, heard in list(self._heard.items()):
                if now - heard >= self.reply_timeout:
                    del self._heard[rid]
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(_SILENT)

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
        self._socket = None

