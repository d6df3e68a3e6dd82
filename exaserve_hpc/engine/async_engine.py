"""The asynchronous face of any step-protocol engine: submit() -> async token chunks.

Call protocol (asyncio callers, one event loop):

1. ``AsyncEngine(engine)`` wraps an engine built on the step protocol of
   engine/base.py (reference, timing, echo, TensorRT-LLM); ``load()`` is the
   engine's constructor, so the wrapper starts with the weights in place.
2. ``warmup()`` once (delegates; raises EngineError on bad output).
3. ``start()`` starts the stepping thread; then any number of concurrent
   ``submit(request)`` calls, each an async iterator of ``StepOutput`` that
   ends after the output with ``finished=True``. Closing the iterator early
   aborts the request. ``submit`` raises ValueError for a request the engine
   can never serve, and EngineError once draining or shut down.
4. ``abort(request_id)``: that request's iterator ends with reason "abort".
5. ``stats()`` any time (thread-safe snapshot).
6. ``drain(timeout)``: no new requests; waits for those in flight, aborts
   whatever is left at the timeout; returns how many it had to abort.
7. ``shutdown()``: stops the thread and the engine (idempotent).

One thread owns the engine (engines are not thread-safe); requests and
aborts reach it through a queue, outputs come back through
``loop.call_soon_threadsafe`` into each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Optional

from .base import Engine, EngineError, EngineRequest, StepOutput


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait: float = 0.002):
        self.engine = engine
        self.idle_wait = idle_wait
        self._commands: "queue.Queue[tuple[str, object]]" = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats: dict = engine.stats()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._draining = False

    # ---------------------------------------------------------------- lifecycle

    def warmup(self) -> None:
        if self._thread is not None:
            raise EngineError("warmup() must run before start(): the stepping thread owns the engine")
        self.engine.warmup()

    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="exaserve-engine", daemon=True)
            self._thread.start()
        return self

    async def drain(self, timeout: float = 30.0) -> int:
        self._draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        left = list(self._streams)
        for request_id in left:
            self.abort(request_id)
        return len(left)

    async def shutdown(self) -> None:
        self._draining = True
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self.engine.shutdown()

    # ---------------------------------------------------------------- requests

    async def submit(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        if self._draining or self._stopping.is_set():
            raise EngineError("the engine is draining or shut down; send the request to another replica")
        if self._thread is None:
            raise EngineError("start() the engine before submitting requests")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request))
        finished = False
        try:
            while True:
                output = await outputs.get()
                if isinstance(output, Exception):
                    finished = True
                    raise output
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._commands.put(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    # ---------------------------------------------------------------- stepping thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            outputs = self.engine.step()
            for output in outputs:
                self._deliver(output.request_id, output)
            with self._lock:
                self._stats = self.engine.stats()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait * 25) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = command
            if kind == "add":
                try:
                    self.engine.add_request(value)
                except (ValueError, EngineError) as exc:  # the caller's iterator raises it
                    self._deliver(value.request_id, exc)
            else:
                self.engine.abort(value)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)
