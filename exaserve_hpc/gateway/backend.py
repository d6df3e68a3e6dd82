"""The seam between the HTTP gateway and whatever serves its requests.

The gateway speaks OpenAI's HTTP API and knows nothing about ZeroMQ,
replicas or retries; it talks to a ``GatewayBackend``. In production that
is the router client over ZeroMQ (gateway/router_client.py); in tests it is an
in-process fake (tests/gateway/fake_backend.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from exaserve_hpc.protocol import GenerateRequest, RequestError, TokenChunk


@dataclass(frozen=True)
class ModelInfo:
    """A model the backend serves, as ``/v1/models`` lists it."""

    name: str
    max_seq_len: int  # prompt tokens + completion tokens must fit in this
    created: int  # unix seconds, shown as the model's "created"
    owned_by: str = "exaserve"


class BackendError(Exception):
    """The serving side refused or failed a request.

    ``status`` is the HTTP status the gateway answers with (404 unknown model,
    429 quota, 503 no replica / overloaded, 504 timeout, 502 replica failed),
    ``code`` a machine-readable reason, ``retry_after`` seconds a client
    should wait before trying again (0: no advice).
    """

    def __init__(self, status: int, code: str, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def from_request_error(cls, error: RequestError) -> "BackendError":
        return cls(error.status, error.code, error.message, error.retry_after)

    def __repr__(self) -> str:
        return f"BackendError(status={self.status}, code={self.code!r}, message={self.message!r})"


@runtime_checkable
class GatewayBackend(Protocol):
    """What the gateway needs from the serving side.

    Call protocol:

    - ``models()``: the models served now; the gateway rejects any other
      model name with 404 and checks prompt lengths against ``max_seq_len``.
      Called on every request, so it must be cheap (no I/O).
    - ``stream(request)``: an async generator. It yields ``TokenChunk``s for
      ``request.request_id`` until (and including) one with
      ``finished=True``, which carries ``finish_reason`` and the token
      counts. When the serving side answers ``RequestError`` (before or after
      the first chunk), it raises ``BackendError`` carrying that error's
      status, code, message and retry_after.

      Abort on early exit: the gateway stops consuming early when the client
      disconnects or a stop string matched. It then either closes the
      generator (``aclose()``, raising ``GeneratorExit`` at the pending
      ``yield``) or cancels the task awaiting its next chunk
      (``CancelledError`` inside the generator). In both cases, unless the
      finished chunk was already yielded, the generator MUST abort the request
      on the serving side (send ``Abort(request_id)``) so the replica stops
      spending compute on it. A ``try/finally`` around the body that aborts
      unless the finished chunk was seen covers both. Cleanup must not block
      the event loop.
    - ``status()``: a JSON-able dict describing the fleet (for
      ``/v1/exaserve/status`` and ``exaserve status``).
    - ``ready()``: True when at least one request could be served now
      (``/health`` answers 200 then, 503 otherwise).
    """

    def models(self) -> list[ModelInfo]: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]: ...

    def status(self) -> dict: ...

    def ready(self) -> bool: ...
