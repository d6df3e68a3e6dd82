"""An in-process GatewayBackend for gateway tests: echoes the prompt back.

The completion is the prompt's own byte tokens (BOS dropped), cut at
max_tokens, sent a few tokens per chunk; a whole echo ends as an engine
ends on its EOS ("stop": the stop token generated, counted, not sent). Knobs make it refuse (BackendError),
dawdle between chunks, hold every request until released, or blow up
mid-stream. It records every request, every abort and every finished stream.

It runs inside the gateway's event loop (uvicorn's thread) while the test
reads it from the main thread, so waiting is by polling with a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Optional

from exaserve_hpc.engine.tokenizer import SPECIAL_IDS
from exaserve_hpc.protocol import GenerateRequest, TokenChunk
from exaserve_hpc.gateway.backend import BackendError, ModelInfo


class FakeBackend:
    def __init__(self, models: list[ModelInfo], tokens_per_chunk: int = 3, chunk_delay: float = 0.0,
                 refuse_with: Optional[BackendError] = None, fail_after_chunks: Optional[int] = None,
                 fail_mid_stream_with: Optional[BaseException] = None, hold: bool = False):
        self._models = models
        self.tokens_per_chunk = tokens_per_chunk
        self.chunk_delay = chunk_delay
        self.refuse_with = refuse_with  # raised before the first chunk
        self.fail_after_chunks = fail_after_chunks  # raise fail_mid_stream_with after this many chunks
        self.fail_mid_stream_with = fail_mid_stream_with or RuntimeError("fake replica exploded")
        self.is_ready = True
        self.hold = hold  # streams wait for release before their first chunk
        self.release = threading.Event()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.streams: list[AsyncIterator[TokenChunk]] = []

    # ---------------------------------------------------------- GatewayBackend

    def models(self) -> list[ModelInfo]:
        return list(self._models)

    def status(self) -> dict:
        return {"backend": "fake", "requests_seen": len(self.requests)}

    def ready(self) -> bool:
        return self.is_ready

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        # Holding a reference keeps garbage collection from finalising (and so "aborting")
        # a stream the gateway forgot to close: only an explicit close or cancel counts.
        stream = self._echo(request)
        self.streams.append(stream)
        return stream

    async def _echo(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        if self.refuse_with is not None:
            raise self.refuse_with
        finished = False
        try:
            while self.hold and not self.release.is_set():
                await asyncio.sleep(0.005)
            echo = [t for t in request.prompt_token_ids if t not in SPECIAL_IDS]
            tokens = echo[: request.max_tokens]
            reason = "length" if len(echo) >= request.max_tokens else "stop"
            pieces = [tokens[i:i + self.tokens_per_chunk] for i in range(0, len(tokens), self.tokens_per_chunk)] or [[]]
            for index, piece in enumerate(pieces):
                if self.fail_after_chunks is not None and index == self.fail_after_chunks:
                    raise self.fail_mid_stream_with
                if self.chunk_delay and index:
                    await asyncio.sleep(self.chunk_delay)
                last = index == len(pieces) - 1
                if last:
                    finished = True
                yield TokenChunk(
                    request_id=request.request_id, token_ids=piece, finished=last,
                    finish_reason=reason if last else None, prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=len(tokens) if last else 0, replica_id="fake-0")
            self.completed.append(request.request_id)
        finally:
            # Closed (GeneratorExit) or cancelled before the finished chunk went out: the
            # real backend sends Abort here; the fake notes it.
            if not finished:
                self.aborted.append(request.request_id)

    # ---------------------------------------------------------- test helpers

    def wait_for(self, condition, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.01)
        return condition()
