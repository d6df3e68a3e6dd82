"""Gateway-side errors and admission: what the gateway refuses before a request reaches the router.

``ApiError`` is a refusal answered with OpenAI's error body; ``Admission``
caps requests in flight for the whole gateway and per quota group (429).

Several gateways (``router.count``): ``exaserve serve`` runs them all in one process, each uvicorn on its own
thread and event loop, and gives them one ``Admission`` (its counts are guarded by a lock), so every limit holds
exactly for all of them together. Under ``exaserve launch`` they run on different ranks; asking rank 0 on every
request would add a round trip to each, so each gateway takes its ``part`` of every limit instead
(quota/shares.py ``split_limit``): the parts add up to the configured limits, and a client, or the centre's load
balancer, should spread a group's requests over the gateways.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Optional

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exaserve_hpc import metrics
from exaserve_hpc.gateway import openai_api as api
from exaserve_hpc.gateway.backend import BackendError
from exaserve_hpc.quota.ledger import UsageRecord
from exaserve_hpc.quota.shares import WHOLE, split_limit

_OVERLOAD_RETRY_AFTER = 1.0  # seconds; a slot frees as soon as any in-flight request ends


_SHARE_REFUSALS = {
    "burst_ceiling": "quota group {group!r} holds its burst_share of model {model!r}'s capacity; wait for one of "
                     "its requests to finish",
    "borrowing_preempted": "model {model!r} is at capacity and quota group {group!r} is past its guaranteed_share: "
                           "borrowed capacity went back to the groups it is guaranteed to; retry after Retry-After",
    "fair_share": "quota group {group!r} holds its fair part of model {model!r}'s spare capacity (groups that used "
                  "less lately go first); retry after Retry-After",
}


class ApiError(Exception):
    """A request the gateway answers with an error status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: float = 0.0):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after


def error_response(error: ApiError, request_id: Optional[str] = None) -> JSONResponse:
    headers = {}
    if error.retry_after > 0 or error.status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(api.error_body(error.status, error.message, error.param, error.code), error.status, headers)


def from_backend_error(error: BackendError) -> ApiError:
    return ApiError(error.status, error.message, code=error.code, retry_after=error.retry_after)


def internal_error(request_id: str, exc: BaseException) -> ApiError:
    return ApiError(500, f"internal error while serving request {request_id} ({type(exc).__name__}: {exc}); "
                    "it has been logged; retry, and report the request id if it persists", code="internal_error")


# ------------------------------------------------------------ request bodies


class BodyTooLarge(StarletteHTTPException):
    """Raised from the ASGI receive of a body past the limit: FastAPI re-raises HTTP exceptions as they are
    (anything else met while reading a body becomes its 400), and the gateway answers it in OpenAI's shape."""

    code = "request_too_large"

    def __init__(self, limit: int, size: Optional[int] = None):
        what = f"is {size} bytes" if size is not None else "goes on"
        super().__init__(413, f"the request body {what}, over this server's limit of {limit} bytes "
                              "(gateway.max_body_bytes); send a smaller request")


class BodyLimit:
    """ASGI middleware capping request bodies at `limit` bytes before they are read into memory.

    A declared Content-Length over the limit is answered 413 at once, unread; a body sent in chunks
    (no length, or a wrong one) is counted as it arrives and refused at the first byte past the limit.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            refusal = BodyTooLarge(self.limit, int(declared))
            return await error_response(ApiError(413, refusal.detail, code=refusal.code))(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted_receive, send)


# ------------------------------------------------------------ admission


class TokenBudget:
    """Tokens (prompt + completion) each quota group used over the last `window` seconds.

    Pure: callers pass the time. A group at or over its limit is refused until
    enough of its recent usage ages out; a request already admitted is charged
    in full when it ends, so a group can overshoot by at most its requests in flight.
    """

    def __init__(self, limits: dict[str, int], window: float = 60.0):
        self.limits = limits
        self.window = window
        self._used: dict[str, deque[tuple[float, int]]] = {g: deque() for g in limits}

    def used(self, group: str, now: float) -> int:
        entries = self._used[group]
        while entries and entries[0][0] <= now - self.window:
            entries.popleft()
        return sum(tokens for _, tokens in entries)

    def wait(self, group: Optional[str], now: float) -> float:
        """0 when the group may start a request now, else seconds until enough usage ages out."""
        if group not in self.limits:
            return 0.0
        limit, used = self.limits[group], self.used(group, now)
        if used < limit:
            return 0.0
        if limit <= 0:  # a gateway holding no part of a split limit (Admission refuses before asking)
            return self.window
        for when, tokens in self._used[group]:  # oldest first
            used -= tokens
            if used < limit:
                return max(0.001, when + self.window - now)
        raise AssertionError("usage is the sum of the entries, and the limit is >= 1")

    def charge(self, group: Optional[str], tokens: int, now: float) -> None:
        if group in self.limits and tokens > 0:
            self._used[group].append((now, tokens))


class Admission:
    """Caps generation requests in flight (whole gateway, per quota group) and each group's tokens per minute.

    With a ``ledger`` (quota/ledger.py), every request that produced tokens is recorded when its ticket is
    released: its group, the group's Slurm account (``accounts``), model, tokens and GPU-seconds
    (``gpu_share[model]``: a replica's GPUs over its batch slots, times the request's seconds).

    ``part``: (this gateway, gateways) when the limits are split over gateways on different ranks (module
    docstring); the limits given are the configured ones, and this gateway holds its part of each. One
    Admission may serve several gateways of one process: ``admit`` and ``release`` hold ``lock``.
    """

    def __init__(self, max_inflight: int, group_limits: dict[str, int],
                 tokens_per_minute: Optional[dict[str, int]] = None, clock: Callable[[], float] = time.monotonic,
                 ledger=None, accounts: Optional[dict[str, str]] = None,
                 gpu_share: Optional[dict[str, float]] = None, shares=None,
                 capacity: Optional[dict[str, int]] = None, part: tuple[int, int] = WHOLE):
        self.part = part
        self.configured = {"max_queued_requests": max_inflight, "max_concurrent_requests": dict(group_limits),
                           "tokens_per_minute": dict(tokens_per_minute or {})}
        self.max_inflight = split_limit(max_inflight, *part)
        self.group_limits = {g: split_limit(n, *part) for g, n in group_limits.items()}
        self.budget = TokenBudget({g: split_limit(n, *part) for g, n in (tokens_per_minute or {}).items()})
        self.clock = clock
        self.lock = threading.Lock()  # several gateways' event loops (threads) admit and release here
        self.inflight = 0
        self.by_group: dict[str, int] = {}
        self.ledger, self.accounts, self.gpu_share = ledger, accounts or {}, gpu_share or {}
        # Guarantees, borrowing and fair share per model (quota/shares.py SharePolicy); capacity: model -> slots
        self.shares, self.capacity = shares, capacity or {}
        self.by_model: dict[str, dict[str, int]] = {}  # model -> group -> requests in flight
        for name, share in (shares.shares.items() if shares is not None else ()):
            metrics.GROUP_SHARE.labels(name, self.accounts.get(name, ""), "guaranteed_share").set(share.guaranteed)
            metrics.GROUP_SHARE.labels(name, self.accounts.get(name, ""), "burst_share").set(share.burst)

    def labels(self, group: Optional[str], model: str) -> tuple[str, str, str]:
        """metrics.GROUP's label values: the group ('none' without one), its account, the model."""
        return group or "none", self.accounts.get(group or "", ""), model

    def _share_used(self, group: Optional[str], model: str) -> None:
        if model in self.capacity:
            used = self.by_model.get(model, {}).get(group or "", 0) / max(1, self.capacity[model])
            metrics.GROUP_SHARE_USED.labels(*self.labels(group, model)).set(used)

    def _split(self, setting: str, configured: int, part: int) -> str:
        """What a refusal adds when the limit is split over gateways on several ranks ('' when it is not)."""
        gateways = self.part[1]
        if gateways == 1:
            return ""
        return (f" ({setting} {configured} is split over the {gateways} gateways of router.count {gateways}; this "
                f"gateway's part is {part}: spread the requests over the gateways serve.json lists)")

    def _refuse_split_out(self, setting: str, configured: int, group: Optional[str], model: str) -> ApiError:
        """A gateway whose part of a limit is 0 (the limit is below router.count) refuses what the limit covers."""
        whose = f"of quota group {group!r} under its " if group else "under gateway."
        return ApiError(429, f"this gateway takes no requests {whose}{setting} {configured}: the limit is "
                        f"split over the {self.part[1]} gateways of router.count {self.part[1]} and this gateway's "
                        f"part is 0; send the requests to gateway 0 (serve.json lists the gateways)",
                        code="quota_exceeded" if group else "overloaded", retry_after=_OVERLOAD_RETRY_AFTER)

    def admit(self, group: Optional[str], model: str = "", prompt_tokens: int = 0,
              request_id: str = "") -> "Ticket":
        with self.lock:
            return self._admit(group, model, prompt_tokens, request_id)

    def _admit(self, group: Optional[str], model: str, prompt_tokens: int, request_id: str) -> "Ticket":
        if self.inflight >= self.max_inflight:
            configured = self.configured["max_queued_requests"]
            if self.max_inflight == 0:
                raise self._refuse_split_out("max_queued_requests", configured, None, model)
            raise ApiError(429, f"the gateway is at its limit of {self.max_inflight} requests in flight "
                           "(gateway.max_queued_requests" + self._split("gateway.max_queued_requests", configured,
                                                                        self.max_inflight)
                           + "); retry after the Retry-After seconds", code="overloaded",
                           retry_after=_OVERLOAD_RETRY_AFTER)
        limit = self.group_limits.get(group) if group else None
        if limit is not None and self.by_group.get(group, 0) >= limit:
            metrics.QUOTA_REJECTIONS.labels(*self.labels(group, model), "max_concurrent_requests").inc()
            configured = self.configured["max_concurrent_requests"][group]
            if limit == 0:
                raise self._refuse_split_out("max_concurrent_requests", configured, group, model)
            raise ApiError(429, f"quota group {group!r} already has {limit} requests in flight, its "
                           "max_concurrent_requests" + self._split("max_concurrent_requests", configured, limit)
                           + "; wait for one to finish", code="quota_exceeded", retry_after=_OVERLOAD_RETRY_AFTER)
        if self.shares is not None and model:
            capacity = self.capacity.get(model, 1)
            refusal = self.shares.decide(group, self.by_model.get(model, {}), capacity, self.clock(), self.part)
            if refusal:
                metrics.QUOTA_REJECTIONS.labels(*self.labels(group, model), refusal).inc()
                raise ApiError(429, _SHARE_REFUSALS[refusal].format(group=group, model=model)
                               + self._split(f"model {model!r}'s slots", capacity,
                                             self.shares.slots(capacity, self.part)),
                               code="quota_exceeded", retry_after=_OVERLOAD_RETRY_AFTER)
        if group in self.budget.limits and self.budget.limits[group] == 0:
            metrics.QUOTA_REJECTIONS.labels(*self.labels(group, model), "tokens_per_minute").inc()
            raise self._refuse_split_out("tokens_per_minute", self.configured["tokens_per_minute"][group], group,
                                         model)
        wait = self.budget.wait(group, self.clock())
        if wait > 0:
            metrics.QUOTA_REJECTIONS.labels(*self.labels(group, model), "tokens_per_minute").inc()
            raise ApiError(429, f"quota group {group!r} used its tokens_per_minute "
                           f"({self.budget.limits[group]} prompt + completion tokens per 60 s"
                           + self._split("tokens_per_minute", self.configured["tokens_per_minute"][group],
                                         self.budget.limits[group])
                           + f"); retry in {wait:.0f} s", code="quota_exceeded", retry_after=wait)
        self.inflight += 1
        if group:
            self.by_group[group] = self.by_group.get(group, 0) + 1
        if model:
            per_group = self.by_model.setdefault(model, {})
            per_group[group or ""] = per_group.get(group or "", 0) + 1
            self._share_used(group, model)
        metrics.INFLIGHT_REQUESTS.inc()
        metrics.GROUP_INFLIGHT.labels(group or "none").inc()
        return Ticket(self, group, model, prompt_tokens, request_id)


class Ticket:
    """One admitted request's slot; ``release`` is idempotent (several paths end a request)."""

    def __init__(self, admission: Admission, group: Optional[str], model: str = "", prompt_tokens: int = 0,
                 request_id: str = ""):
        self._admission, self._group, self._held = admission, group, True
        self._model, self._prompt_tokens, self._request_id = model, prompt_tokens, request_id
        self._admitted = admission.clock()

    def release(self, tokens: int = 0) -> None:
        """Free the slot; `tokens` (prompt + completion) count against the group's tokens_per_minute."""
        with self._admission.lock:
            if not self._held:
                return
            self._held = False
            self._admission.budget.charge(self._group, tokens, self._admission.clock())
            self._admission.inflight -= 1
            if self._group:
                self._admission.by_group[self._group] -= 1
            if self._model:
                self._admission.by_model[self._model][self._group or ""] -= 1
                self._admission._share_used(self._group, self._model)
            if self._admission.shares is not None and tokens > self._prompt_tokens:  # billed as the ledger counts
                self._admission.shares.usage.add(self._group or "", tokens, self._admission.clock())
        metrics.INFLIGHT_REQUESTS.dec()
        metrics.GROUP_INFLIGHT.labels(self._group or "none").dec()
        if tokens > 0:
            metrics.GROUP_TOKENS.labels(self._group or "none").inc(tokens)
        labels = self._admission.labels(self._group, self._model)
        metrics.GROUP_REQUESTS.labels(*labels).inc()
        if tokens - self._prompt_tokens > 0:  # as the ledger bills (_bill)
            metrics.GROUP_PROMPT_TOKENS.labels(*labels).inc(self._prompt_tokens)
            metrics.GROUP_COMPLETION_TOKENS.labels(*labels).inc(tokens - self._prompt_tokens)
        self._bill(tokens)

    def _bill(self, tokens: int) -> None:
        """Into the ledger, when the request produced tokens (one refused or failed before its first is not billed)."""
        admission = self._admission
        completion = tokens - self._prompt_tokens
        if admission.ledger is None or completion <= 0:
            return
        seconds = max(0.0, admission.clock() - self._admitted)
        group = self._group or "none"
        admission.ledger.record(UsageRecord(
            t=time.time(), request_id=self._request_id, group=group, account=admission.accounts.get(group, ""),
            model=self._model, prompt_tokens=self._prompt_tokens, completion_tokens=completion,
            gpu_seconds=round(seconds * admission.gpu_share.get(self._model, 0.0), 6)))
