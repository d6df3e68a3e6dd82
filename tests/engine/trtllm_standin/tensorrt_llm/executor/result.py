"""The stand-in's GenerationResult: the rules of tensorrt_llm/executor/result.py that exaserve relies on.

Rules enforced (each as the real file has it, TensorRT-LLM 1.x, GenerationResultBase / GenerationResult):

- The async queue exists only if an event loop runs in the creating thread: ``__init__`` makes an
  ``AsyncQueue`` when ``has_event_loop()`` is true, else a plain ``queue.Queue`` and ``aqueue = None``.
  ``async for`` (``__anext__`` -> ``_aresult_step``) then asserts ``self.aqueue is not None`` with the
  message "The asyncio event loop was not present during initialization, so async operations are not
  available." The loop that was running at creation is the one the responses are delivered to
  (AsyncQueue.sync_q puts through ``loop.call_soon_threadsafe``, tensorrt_llm/llmapi/utils.py).
- ``outputs[0].token_ids`` is cumulative; ``finished`` turns true with the last response.
- Finish reasons (``_handle_sequence``): END_ID and STOP_WORDS -> "stop", LENGTH -> "length", CANCELLED ->
  "cancelled". For STOP_WORDS the matched stop ids are cut from ``token_ids`` (``include_stop_str_in_output``
  False) and ``stop_reason`` names the stop id; an END_ID token stays (the PyTorch sampler appends the token
  before it checks ``new_token == request.py_end_id``, tensorrt_llm/_torch/pyexecutor/sampler.py).
- ``abort()`` asserts an executor is set ("The executor is not set for this result.") and calls
  ``executor.abort_request(request_id)``; the request then ends with a final response whose finish reason
  is "cancelled".
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Optional

from .utils import has_event_loop

NO_LOOP = ("The asyncio event loop was not present during initialization, so async operations are not "
           "available.")


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None  # 'stop' | 'length' | 'timeout' | 'cancelled'
    stop_reason: Optional[int] = None


class _AsyncQueue:
    """An asyncio.Queue bound to the loop running at creation, fed from other threads (llmapi/utils.py)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.aq: asyncio.Queue = asyncio.Queue()

    def put_threadsafe(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.aq.put_nowait, item)
        except RuntimeError:  # that loop is closed: nobody will read it (as with the real AsyncQueue)
            pass


class GenerationResult:
    def __init__(self, request_id: int, sampling_params, executor, streaming: bool) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self._executor = executor
        self._streaming = streaming
        self._done = False
        self._aborted = False
        self._outputs = [CompletionOutput(0)]
        if has_event_loop():
            self.aqueue: Optional[_AsyncQueue] = _AsyncQueue()
            self.queue = None
        else:
            self.aqueue = None
            self.queue = queue.Queue()

    # ------------------------------------------------ fed by the stand-in's executor thread
    def _deliver(self, response) -> None:
        if self.aqueue is not None:
            self.aqueue.put_threadsafe(response)
        else:
            self.queue.put(response)

    def _handle_response(self, response) -> None:
        new_tokens, final, reason = response
        out = self._outputs[0]
        out.token_ids = out.token_ids + list(new_tokens)
        self._done = final
        if reason == "CANCELLED":
            out.finish_reason = "cancelled"
        elif final:
            if reason == "END_ID":
                out.finish_reason = "stop"
            elif reason == "STOP_WORDS":
                out.finish_reason = "stop"
                for stop in self.sampling_params.stop_token_ids or ():
                    if out.token_ids[-1:] == [stop]:
                        out.stop_reason = stop
                        if not self.sampling_params.include_stop_str_in_output:
                            out.token_ids = out.token_ids[:-1]
                        break
            elif reason == "LENGTH":
                out.finish_reason = "length"
            else:
                raise ValueError(f"Unknown finish reason: {reason}")

    # ------------------------------------------------ the public surface
    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        assert self._executor is not None, "The executor is not set for this result."
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _result_step(self, timeout: Optional[float] = None) -> None:
        if self.queue is None:  # made on a loop: the real one's sync_q reads the same loop-bound queue
            raise RuntimeError("stand-in: a result made on an event loop is read with `async for`/aresult")
        self._handle_response(self.queue.get(timeout=timeout))

    async def _aresult_step(self) -> None:
        assert self.aqueue is not None, NO_LOOP
        self._handle_response(await self.aqueue.aq.get())

    def result(self, timeout: Optional[float] = None) -> "GenerationResult":
        while not self._done:
            self._result_step(timeout)
        return self

    async def aresult(self) -> "GenerationResult":
        while not self._done:
            await self._aresult_step()
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        return self

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        self._result_step()
        return self
