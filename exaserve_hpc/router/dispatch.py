"""The router's bookkeeping: who serves which request, and what to do when a replica fails.

`Dispatcher` is transport-free: every entry point takes the current time and
returns the messages to send (`Outgoing`); `router/zmq_router.py` owns the
sockets and carries them out. That keeps the failure paths (replica silent,
replica error mid-stream, deadline passed, no replica yet) unit-testable.

Invariants:
- every accepted request ends with exactly one finished TokenChunk or one
  RequestError sent to its gateway;
- a request that fails on a replica is retried on another one by
  re-prefilling prompt + tokens already sent, so the client's stream goes on
  where it stopped (at most `max_attempts` replicas in all).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..protocol import (
    Abort, Drain, GenerateRequest, Message, ReplicaBye, ReplicaHello, ReplicaStats, RequestError, TokenChunk,
)
from .balancing import BalancingPolicy, ReplicaLoad

log = logging.getLogger(__name__)

GATEWAY, REPLICA = "gateway", "replica"


@dataclass
class Outgoing:
    side: str  # GATEWAY or REPLICA
    peer: bytes  # ZeroMQ identity of the receiver
    message: Message


@dataclass
class ReplicaEntry:
    load: ReplicaLoad
    last_seen: float
    node: str = ""
    pid: int = 0
    draining: bool = False


@dataclass
class Inflight:
    request: GenerateRequest  # as the gateway sent it
    gateway: bytes
    accepted_at: float
    deadline: float
    replica_id: Optional[str] = None
    dispatched_at: float = 0.0
    sent_tokens: list[int] = field(default_factory=list)
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    last_failure: str = ""


@dataclass
class DispatchSettings:
    max_attempts: int = 3
    request_timeout: float = 300.0
    first_token_timeout: float = 60.0
    replica_expiry: float = 3.0


class Dispatcher:
    def __init__(self, policy: BalancingPolicy, settings: DispatchSettings, known_models: set[str]):
        self.policy = policy
        self.settings = settings
        self.known_models = set(known_models)
        self.replicas: dict[str, ReplicaEntry] = {}
        self.inflight: dict[str, Inflight] = {}
        self.pending: deque[str] = deque()  # request ids waiting for a replica of their model
        self.counters = {"accepted": 0, "completed": 0, "failed": 0, "retries": 0}

    # ---------------------------------------------------------------- gateway side

    def on_request(self, gateway: bytes, request: GenerateRequest, now: float) -> list[Outgoing]:
        if request.model not in self.known_models:
            return [self._error_to(gateway, request.request_id, 404, "model_not_found",
                                   f"model {request.model!r} is not served; served models: "
                                   + ", ".join(sorted(self.known_models)))]
        if request.request_id in self.inflight:
            return [self._error_to(gateway, request.request_id, 409, "duplicate_request",
                                   f"request id {request.request_id!r} is already in flight")]
        deadline = now + (request.timeout or self.settings.request_timeout)
        entry = Inflight(request=request, gateway=gateway, accepted_at=now, deadline=deadline)
        self.inflight[request.request_id] = entry
        self.counters["accepted"] += 1
        return self._dispatch(entry, now)

    def on_abort(self, request_id: str) -> list[Outgoing]:
        entry = self.inflight.pop(request_id, None)
        if entry is None:
            return []
        if request_id in self.pending:
            self.pending.remove(request_id)
        return self._release(entry, abort=True)

    # ---------------------------------------------------------------- replica side

    def on_replica_message(self, replica_id: str, message: Message, now: float) -> list[Outgoing]:
        if isinstance(message, ReplicaHello):
            self.replicas[replica_id] = ReplicaEntry(
                load=ReplicaLoad(replica_id, message.model, 0, message.max_batch_size),
                last_seen=now, node=message.node, pid=message.pid)
            log.info("replica %s registered (model %s, node %s)", replica_id, message.model, message.node)
            return self._drain_pending(now)
        entry = self.replicas.get(replica_id)
        if entry is None:
            # A replica we dropped (expired) speaks again: make it say hello first.
            return [Outgoing(REPLICA, replica_id.encode(), Drain(timeout=0))] if isinstance(message, ReplicaStats) else []
        entry.last_seen = now
        if isinstance(message, ReplicaStats):
            entry.load.queue_depth = message.queue_depth
            entry.load.kv_used = message.kv_used
            entry.load.latency_ewma_ms = message.latency_ewma_ms
            return []
        if isinstance(message, TokenChunk):
            return self._on_chunk(replica_id, message)
        if isinstance(message, RequestError):
            return self._on_replica_error(replica_id, message, now)
        if isinstance(message, ReplicaBye):
            return self.replica_lost(replica_id, f"replica left ({message.reason})", now, expected=True)
        log.warning("unexpected %s from replica %s", type(message).__name__, replica_id)
        return []

    def replica_lost(self, replica_id: str, cause: str, now: float, expected: bool = False) -> list[Outgoing]:
        """Drop a replica from rotation and move its in-flight requests elsewhere."""
        if self.replicas.pop(replica_id, None) is None:
            return []
        log.log(logging.INFO if expected else logging.WARNING, "replica %s out of rotation: %s", replica_id, cause)
        out: list[Outgoing] = []
        for entry in [e for e in self.inflight.values() if e.replica_id == replica_id]:
            out += self._retry(entry, f"replica {replica_id} lost: {cause}", now)
        return out

    def drain(self, replica_id: str) -> list[Outgoing]:
        """Stop sending new work to a replica; it leaves when its requests finish."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            return []
        entry.draining = True
        return [Outgoing(REPLICA, replica_id.encode(), Drain())]

    # ---------------------------------------------------------------- time

    def tick(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for replica_id, entry in list(self.replicas.items()):
            if now - entry.last_seen > self.settings.replica_expiry:
                out += self.replica_lost(replica_id, f"silent for {now - entry.last_seen:.1f}s", now)
        for entry in list(self.inflight.values()):
            rid = entry.request.request_id
            if now > entry.deadline:
                out += self._fail(entry, 504, "deadline_exceeded",
                                  f"request {rid} did not finish within its deadline "
                                  f"({entry.deadline - entry.accepted_at:.0f}s)")
            elif entry.replica_id is None and now - entry.accepted_at > self.settings.first_token_timeout:
                out += self._fail(entry, 503, "no_replica",
                                  f"no replica of model {entry.request.model!r} could take request {rid} within "
                                  f"{self.settings.first_token_timeout:.0f}s"
                                  + (f"; last failure: {entry.last_failure}" if entry.last_failure else ""))
            elif (entry.replica_id and not entry.sent_tokens
                  and now - entry.dispatched_at > self.settings.first_token_timeout):
                out += self._retry(entry, f"no first token from {entry.replica_id} within "
                                          f"{self.settings.first_token_timeout:.0f}s", now)
        return out + self._drain_pending(now)

    # ---------------------------------------------------------------- status

    def snapshot(self) -> dict:
        return {
            "replicas": [
                {"replica_id": rid, "model": e.load.model, "node": e.node, "pid": e.pid,
                 "outstanding": e.load.outstanding, "queue_depth": e.load.queue_depth,
                 "draining": e.draining}
                for rid, e in sorted(self.replicas.items())
            ],
            "inflight": len(self.inflight),
            "pending": len(self.pending),
            **self.counters,
        }

    # ---------------------------------------------------------------- internals

    def _candidates(self, model: str) -> list[ReplicaLoad]:
        return [e.load for e in self.replicas.values() if e.load.model == model and not e.draining]

    def _dispatch(self, entry: Inflight, now: float) -> list[Outgoing]:
        request = entry.request
        replica_id = self.policy.choose(self._candidates(request.model), frozenset(entry.tried))
        if replica_id is None and entry.tried:
            # Every replica was tried once; a second go on a healthy one beats failing.
            replica_id = self.policy.choose(self._candidates(request.model))
        if replica_id is None:
            if request.request_id not in self.pending:
                self.pending.append(request.request_id)
            return []
        entry.replica_id = replica_id
        entry.dispatched_at = now
        entry.attempts += 1
        entry.tried.add(replica_id)
        self.replicas[replica_id].load.outstanding += 1
        sent = len(entry.sent_tokens)
        to_send = request if not sent else GenerateRequest(
            request_id=request.request_id, model=request.model,
            prompt_token_ids=request.prompt_token_ids + entry.sent_tokens,
            max_tokens=request.max_tokens - sent, temperature=request.temperature, top_p=request.top_p,
            seed=request.seed, timeout=request.timeout, quota_group=request.quota_group, resumed_tokens=sent)
        return [Outgoing(REPLICA, replica_id.encode(), to_send)]

    def _drain_pending(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for _ in range(len(self.pending)):
            entry = self.inflight.get(self.pending.popleft())
            if entry is not None:
                out += self._dispatch(entry, now)  # re-queues itself when no replica can take it
        return out

    def _on_chunk(self, replica_id: str, chunk: TokenChunk) -> list[Outgoing]:
        entry = self.inflight.get(chunk.request_id)
        if entry is None or entry.replica_id != replica_id:
            return []  # late chunk from a replica we already moved away from
        entry.sent_tokens.extend(chunk.token_ids)
        forwarded = TokenChunk(
            request_id=chunk.request_id, token_ids=chunk.token_ids, finished=chunk.finished,
            finish_reason=chunk.finish_reason, prompt_tokens=len(entry.request.prompt_token_ids),
            completion_tokens=len(entry.sent_tokens), replica_id=replica_id)
        out = [Outgoing(GATEWAY, entry.gateway, forwarded)]
        if chunk.finished:
            self.inflight.pop(chunk.request_id)
            self.counters["completed"] += 1
            out += self._release(entry, abort=False)
        return out

    def _on_replica_error(self, replica_id: str, error: RequestError, now: float) -> list[Outgoing]:
        entry = self.inflight.get(error.request_id)
        if entry is None or entry.replica_id != replica_id:
            return []
        if 400 <= error.status < 500:  # the request itself is bad: another replica won't help
            return self._fail(entry, error.status, error.code, error.message)
        return self._retry(entry, f"replica {replica_id}: {error.message}", now)

    def _retry(self, entry: Inflight, cause: str, now: float) -> list[Outgoing]:
        out = self._release(entry, abort=True)
        entry.replica_id = None
        entry.last_failure = cause
        if entry.attempts >= self.settings.max_attempts:
            return out + self._fail(entry, 503, "replicas_failed",
                                    f"request failed on {entry.attempts} replica(s); last cause: {cause}",
                                    release=False)
        remaining = entry.request.max_tokens - len(entry.sent_tokens)
        if remaining <= 0:
            self.inflight.pop(entry.request.request_id, None)
            self.counters["completed"] += 1
            return out + [Outgoing(GATEWAY, entry.gateway, TokenChunk(
                request_id=entry.request.request_id, token_ids=[], finished=True, finish_reason="length",
                prompt_tokens=len(entry.request.prompt_token_ids), completion_tokens=len(entry.sent_tokens)))]
        self.counters["retries"] += 1
        log.info("retrying %s after %d token(s): %s", entry.request.request_id, len(entry.sent_tokens), cause)
        return out + self._dispatch(entry, now)

    def _fail(self, entry: Inflight, status: int, code: str, message: str, release: bool = True) -> list[Outgoing]:
        self.inflight.pop(entry.request.request_id, None)
        if entry.request.request_id in self.pending:
            self.pending.remove(entry.request.request_id)
        self.counters["failed"] += 1
        out = self._release(entry, abort=True) if release else []
        return out + [self._error_to(entry.gateway, entry.request.request_id, status, code, message)]

    def _release(self, entry: Inflight, abort: bool) -> list[Outgoing]:
        if entry.replica_id is None:
            return []
        replica = self.replicas.get(entry.replica_id)
        out = []
        if replica is not None:
            replica.load.outstanding = max(0, replica.load.outstanding - 1)
            if abort:
                out.append(Outgoing(REPLICA, entry.replica_id.encode(), Abort(request_id=entry.request.request_id)))
        return out

    @staticmethod
    def _error_to(gateway: bytes, request_id: str, status: int, code: str, message: str) -> Outgoing:
        retry_after = 1.0 if status in (429, 503) else 0.0
        return Outgoing(GATEWAY, gateway, RequestError(request_id=request_id, status=status, code=code,
                                                       message=message, retry_after=retry_after))
