"""One admitted generation: backend token chunks -> text (stop strings applied) -> JSON or SSE events.

``Generation`` owns the backend stream of one request; closing it aborts the
request on the serving side if it has not finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Optional

import anyio
from fastapi import Request

from exaserve_hpc import metrics
from exaserve_hpc.gateway import openai_api as api
from exaserve_hpc.gateway.admission import Ticket, internal_error
from exaserve_hpc.gateway.backend import BackendError, GatewayBackend
from exaserve_hpc.protocol import GenerateRequest, TokenChunk

log = logging.getLogger(__name__)

COMPLETIONS = "completions"
CHAT = "chat.completions"


class ServerStopping(BackendError):
    """The gateway is stopping and its grace for open requests is over: the request ends with this (an SSE
    error event and `data: [DONE]`, or a 503 when nothing was sent yet)."""

    def __init__(self, message: str):
        super().__init__(503, "server_stopping", message, retry_after=5.0)


class StopGate:
    """The gateway's open generations, so a stop can end them cleanly rather than cut them
    (gateway/server.py gateway_server): ``stopping`` from the stop signal on (new requests get 503,
    /health says so), then ``interrupt_all`` when the grace is over."""

    def __init__(self) -> None:
        self.open: set["Generation"] = set()
        self.stopping = False

    def interrupt_all(self, why: str) -> int:
        generations = list(self.open)
        for gen in generations:
            gen.interrupt(why)
        return len(generations)




class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._longest = max(map(len, stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched); after a match the rest is dropped."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[:min(hits)], True
        keep = self._partial_stop_at_end(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_stop_at_end(self, buffer: str) -> int:
        for size in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0


class Generation:
    """One admitted request: backend token chunks -> text, until finished or a stop string matches.

    ``close()`` must be called whatever happens (it is idempotent): it closes
    the backend stream (aborting the request there if it was not finished),
    frees the admission slot and counts the tokens.
    """

    def __init__(self, backend: GatewayBackend, request: GenerateRequest, stops: list[str], ticket: Ticket,
                 arrived: float, decoder, gate: Optional[StopGate] = None):
        """``decoder``: the model tokenizer's incremental detokenizer for this request (``feed(ids)`` -> text
        that is final, ``flush()`` at the end). ``gate``: where the gateway finds it to end it on a stop."""
        self.request = request
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self._chunks = backend.stream(request)
        self._first: Optional[TokenChunk] = None
        self._decoder = decoder
        self._stops = StopMatcher(stops)
        self._ticket = ticket
        self._arrived = arrived
        self._closed = False
        self._first_at = self._last_at = 0.0  # perf_counter() of the first and the latest token chunk
        self._interrupted = ""  # why the gateway ended it (interrupt())
        self._waiting: Optional[asyncio.Task] = None  # the task awaiting the next chunk, while it does
        self._cancelled_by_us = False
        self._gate = gate
        if gate is not None:
            gate.open.add(self)

    def interrupt(self, why: str) -> None:
        """End this generation from the gateway (it is stopping): the wait for the next chunk, or the next
        one, raises ServerStopping, which the caller answers as an error (an SSE error event and [DONE])."""
        if self._interrupted or self._closed:
            return
        self._interrupted = why
        task = self._waiting
        if task is not None and not task.done():
            self._cancelled_by_us = True
            task.cancel()

    async def start(self) -> None:
        """Wait for the first chunk, so that a refusal can still be answered with its HTTP status."""
        if self._first is None:
            self._first = await self._next_chunk()
            self._first_at = self._last_at = time.perf_counter()
            metrics.TIME_TO_FIRST_TOKEN.labels(self.request.model).observe(time.perf_counter() - self._arrived)

    async def texts(self) -> AsyncIterator[str]:
        """Pieces of completion text; when it ends, ``finish_reason`` is set."""
        await self.start()
        chunk = self._first
        while True:
            self.completion_tokens += len(chunk.token_ids)
            text = self._decoder.feed(chunk.token_ids)
            if chunk.finished:
                text += self._decoder.flush()
            text, stopped = self._stops.feed(text)
            if stopped:
                self.finish_reason = "stop"
            elif chunk.finished:
                text += self._stops.flush()
                self.finish_reason = chunk.finish_reason or "stop"
                if chunk.finish_reason == "stop":
                    # The engine stopped on an EOS / stop id: generated, so counted (as vLLM and OpenAI count
                    # it), but never sent (engine/base.py StepOutput)
                    self.completion_tokens += 1
            if text:
                yield text
            if self.finish_reason:
                return
            chunk = await self._next_chunk()
            self._last_at = time.perf_counter()

    async def _next_chunk(self) -> TokenChunk:
        if self._interrupted:
            raise ServerStopping(self._interrupted)
        self._waiting = asyncio.current_task()
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"the backend stream of request {self.request.request_id} ended without "
                               "a finished chunk") from None
        except asyncio.CancelledError:
            if not self._cancelled_by_us:
                raise
            self._cancelled_by_us = False
            task = asyncio.current_task()
            if task is not None and task.uncancel() > 0:  # cancelled by someone else too (a disconnect)
                raise
            raise ServerStopping(self._interrupted) from None
        finally:
            self._waiting = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._gate is not None:
            self._gate.open.discard(self)
        try:
            # Shielded: on a client disconnect this runs inside a cancelled task, and the
            # backend still has to hear about the abort.
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
        finally:
            self._ticket.release(tokens=self.prompt_tokens + self.completion_tokens)
            metrics.GENERATED_TOKENS.labels(self.request.model).inc(self.completion_tokens)
            if self.finish_reason and self.completion_tokens > 1 and self._last_at > self._first_at:
                metrics.TIME_PER_OUTPUT_TOKEN.labels(self.request.model).observe(
                    (self._last_at - self._first_at) / (self.completion_tokens - 1))


# ------------------------------------------------------------ response shapes


def json_answer(endpoint: str, gen: Generation, text: str) -> dict:
    rid, created, model = gen.request.request_id, api.now(), gen.request.model
    usage = api.usage(gen.prompt_tokens, gen.completion_tokens)
    if endpoint == CHAT:
        return api.chat_body(api.new_chat_completion_id(rid), created, model, text, gen.finish_reason, usage)
    return api.completion_body(api.new_completion_id(rid), created, model, text, gen.finish_reason, usage)


class _CompletionEvents:
    """SSE chunks of /v1/completions."""

    object = "text_completion"

    def __init__(self, gen: Generation, include_usage: bool):
        self.id = api.new_completion_id(gen.request.request_id)
        self.created, self.model, self.include_usage = api.now(), gen.request.model, include_usage

    def opening(self) -> list[bytes]:
        return []

    def text(self, text: str, finish_reason: Optional[str] = None) -> bytes:
        return api.sse_event(api.completion_chunk(self.id, self.created, self.model, text, finish_reason,
                                                  self.include_usage))

    def finish(self, reason: str) -> bytes:
        return self.text("", reason)

    def usage(self, usage: dict) -> bytes:
        return api.sse_event(api.usage_chunk(self.object, self.id, self.created, self.model, usage))


class _ChatEvents(_CompletionEvents):
    """SSE chunks of /v1/chat/completions: the role comes first, then content deltas."""

    object = "chat.completion.chunk"

    def __init__(self, gen: Generation, include_usage: bool):
        super().__init__(gen, include_usage)
        self.id = api.new_chat_completion_id(gen.request.request_id)

    def _delta(self, delta: dict, finish_reason: Optional[str] = None) -> bytes:
        return api.sse_event(api.chat_chunk(self.id, self.created, self.model, delta, finish_reason,
                                            self.include_usage))

    def opening(self) -> list[bytes]:
        return [self._delta({"role": "assistant", "content": ""})]

    def text(self, text: str, finish_reason: Optional[str] = None) -> bytes:
        return self._delta({"content": text})

    def finish(self, reason: str) -> bytes:
        return self._delta({}, reason)


async def sse_events(endpoint: str, gen: Generation, include_usage: bool) -> AsyncIterator[bytes]:
    events = (_ChatEvents if endpoint == CHAT else _CompletionEvents)(gen, include_usage)
    try:
        try:
            for event in events.opening():
                yield event
            async for text in gen.texts():
                yield events.text(text)
            yield events.finish(gen.finish_reason)
            if include_usage:
                yield events.usage(api.usage(gen.prompt_tokens, gen.completion_tokens))
        except BackendError as exc:
            yield api.sse_event(api.error_body(exc.status, exc.message, code=exc.code))
        except Exception as exc:  # headers are sent: the only way left to answer is an error event
            log.exception("request %s failed mid-stream", gen.request.request_id)
            error = internal_error(gen.request.request_id, exc)
            yield api.sse_event(api.error_body(500, error.message, code=error.code))
        yield api.SSE_DONE
    finally:
        await gen.close()


async def collect_unless_disconnected(request: Request, gen: Generation) -> Optional[str]:
    """The whole completion text, or None if the client hung up first (the generation is then abandoned)."""

    async def collect() -> str:
        return "".join([text async for text in gen.texts()])

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collector, watcher):
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    return collector.result() if not collector.cancelled() else None
