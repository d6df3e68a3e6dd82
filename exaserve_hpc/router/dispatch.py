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
  where it stopped (at most `max_attempts` replicas in all);
- a replica is a candidate only while it is registered, not draining and its
  circuit breaker lets work through (`breaker.py`); candidates live in one
  `ReplicaPool` per model (and per model version, for canaries), so a
  routing decision never walks the fleet.

Failures that count against a replica's breaker: a 5xx error for a request,
no first token within ``first_token_timeout``, a stream silent for
``stall_timeout``. A first token counts as a success.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import msgspec

from exaserve_hpc.protocol import (
    Abort, Drain, GenerateRequest, Message, ReplicaBye, ReplicaHello, ReplicaStats, RequestError, Routers, SayHello,
    TokenChunk,
    unpack_hashes, unpack_request,
)
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, RoutingKey, RoutingPolicy, set_latency, shift_prefilling
from exaserve_hpc.router.breaker import BreakerState, CircuitBreaker
from exaserve_hpc.router.canary import RolloutTable
from exaserve_hpc.router.dispatch_state import (  # noqa: F401 - re-exported: the records belong to the dispatcher's API
    GATEWAY, REPLICA, DispatchSettings, Inflight, Outgoing, ReplicaEntry, RoutedRequest, _Excluded, attempt_id,
)

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, policy: RoutingPolicy, settings: DispatchSettings, known_models: set[str], rollouts=None):
        self.policy = policy  # called as RoutingPolicy's docstring says (balancing.py)
        self._uses_prefix = policy.uses_prefix
        self.settings = settings
        self.known_models = set(known_models)
        self.rollouts = rollouts if rollouts is not None else RolloutTable()  # which version takes a request
        self.replicas: dict[str, ReplicaEntry] = {}
        self.pools: dict[str, ReplicaPool] = {}  # model -> its replicas
        self.version_pools: dict[tuple[str, str], ReplicaPool] = {}  # (model, version) -> its replicas
        self.unavailable: set[str] = set()  # registered but no new work: draining, breaker open, probe out
        self.open_breakers: set[str] = set()
        self.inflight: dict[str, Inflight] = {}
        # a retry's replica-side id -> its request's id: each attempt after the first carries its own id
        # (attempt_id), so a replica still running an earlier attempt (a false loss, a stall) never sees a
        # duplicate, and that attempt's late chunks are told apart and dropped
        self.attempts: dict[str, str] = {}
        self.pending: deque[str] = deque()  # request ids waiting for a replica of their model
        self.counters = {"accepted": 0, "completed": 0, "failed": 0, "retries": 0, "breaker_opened": 0}
        self.reasons: dict[str, int] = {}  # routing branch -> count (policy Decision.reason)
        self.router_backends: list[str] = []  # every router's backend when several share the fleet (set_routers)

    # ---------------------------------------------------------------- gateway side

    def on_request(self, gateway: bytes, request: "GenerateRequest | RoutedRequest", now: float,
                   raw: Optional[memoryview] = None) -> list[Outgoing]:
        """A request from a gateway. ``raw``: its frame as received (the router's thread decodes a
        `RoutedRequest`, prompt left encoded): the first attempt sends those bytes on unchanged."""
        if request.model not in self.known_models:
            return [self._error_to(gateway, request.request_id, 404, "model_not_found",
                                   f"model {request.model!r} is not served; served models: "
                                   + ", ".join(sorted(self.known_models)))]
        if request.request_id in self.inflight:
            return [self._error_to(gateway, request.request_id, 409, "duplicate_request",
                                   f"request id {request.request_id!r} is already in flight")]
        if request.__class__ is GenerateRequest and (request.prompt_packed or request.hashes_packed):
            unpack_request(request)  # handed over in-process as a gateway packs it: lists from here on
        deadline = now + (request.timeout or self.settings.request_timeout)
        try:
            prompt = request.prompt_token_ids  # a RoutedRequest's is made on each access: once here
        except msgspec.ValidationError as exc:  # its id decoded: answer it rather than leave it waiting
            return [self._error_to(gateway, request.request_id, 400, "invalid_request",
                                   f"request {request.request_id!r} has an unreadable prompt: {exc}")]
        entry = Inflight(request=request, gateway=gateway, accepted_at=now, deadline=deadline,
                         prompt=prompt, prompt_len=len(prompt), raw=raw)
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
            return self.register(replica_id, message, now)
        entry = self.replicas.get(replica_id)
        if entry is None:
            # A replica we dropped (expired) speaks again, or its hello never came: ask for its hello. Not
            # Drain(timeout=0), as before: with several routers that stopped the replica for all of them
            # when only its link to this one had failed; a replica that was slow is healthy again anyway.
            return [Outgoing(REPLICA, replica_id.encode(), SayHello())] if isinstance(message, ReplicaStats) else []
        entry.last_seen = now
        if isinstance(message, ReplicaStats):
            entry.load.queue_depth = message.queue_depth
            entry.load.kv_used = message.kv_used
            entry.prefix_hit_tokens = message.prefix_hit_tokens
            entry.prefix_query_tokens = message.prefix_query_tokens
            entry.kv_blocks_cached = message.kv_blocks_cached
            entry.running, entry.requests_finished = message.running, message.requests_finished
            entry.tokens_generated = message.tokens_generated
            entry.latency_ms = (message.ttft_ms_p50, message.ttft_ms_p99, message.tpot_ms_p50, message.tpot_ms_p99)
            set_latency(entry.load, entry.pools, message.latency_ewma_ms)  # the model's pool and its version's
            return []
        if isinstance(message, TokenChunk):
            return self._on_chunk(replica_id, message, now)
        if isinstance(message, RequestError):
            return self._on_replica_error(replica_id, message, now)
        if isinstance(message, ReplicaBye):
            return self.replica_lost(replica_id, f"replica left ({message.reason})", now, expected=True)
        log.warning("unexpected %s from replica %s", type(message).__name__, replica_id)
        return []

    def on_chunk(self, replica_id: str, chunk: TokenChunk, now: float) -> list[Outgoing]:
        """`on_replica_message` for a TokenChunk (most replica messages), without its type tests."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            return []
        entry.last_seen = now
        return self._on_chunk(replica_id, chunk, now)

    def on_chunks(self, replica_id: str, chunks: list[TokenChunk], now: float) -> list[Outgoing]:
        """A replica's TokenChunks: `on_chunk` for each, in order."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            return []
        entry.last_seen = now
        out: list[Outgoing] = []
        inflight, attempts = self.inflight, self.attempts
        for chunk in chunks:
            # Most chunks are a stream's middle: its request is here, past its first token, not finished.
            # They are forwarded here without a call or a new object each (the router pays per chunk);
            # anything else goes through `_on_chunk`.
            flight = inflight.get(chunk.request_id)
            if (flight is None or chunk.finished or not flight.first_token_at or flight.replica_id != replica_id
                    or flight.wire_id or attempts):
                out += self._on_chunk(replica_id, chunk, now)
                continue
            flight.last_token_at = now
            sent = flight.sent_tokens
            sent.extend(chunk.token_ids)
            chunk.prompt_tokens, chunk.completion_tokens, chunk.replica_id = flight.prompt_len, len(sent), replica_id
            out.append(Outgoing(GATEWAY, flight.gateway, chunk))  # the chunk itself, now the gateway's
        return out

    def register(self, replica_id: str, hello: ReplicaHello, now: float) -> list[Outgoing]:
        if replica_id in self.replicas:  # it restarted under the same id: its cache is new
            self._unregister(replica_id)
        entry = ReplicaEntry(load=ReplicaLoad(replica_id, hello.model, 0, hello.max_batch_size),
                             last_seen=now, node=hello.node, pid=hello.pid, version=hello.version,
                             breaker=CircuitBreaker(self.settings.breaker))
        self.replicas[replica_id] = entry
        entry.pools = [self.pools.setdefault(hello.model, ReplicaPool()),
                       self.version_pools.setdefault((hello.model, hello.version), ReplicaPool())]
        for pool in entry.pools:
            pool.add(entry.load)
        log.info("replica %s registered (model %s%s, node %s)", replica_id, hello.model,
                 f" version {hello.version}" if hello.version else "", hello.node)
        out = self._drain_pending(now)
        if self.router_backends and not set(self.router_backends) <= set(hello.routers):
            # it started before a router registered: name them all, its links join the ones it lacks
            out.append(Outgoing(REPLICA, replica_id.encode(), Routers(backends=list(self.router_backends))))
        return out

    def set_routers(self, backends: list[str]) -> list[Outgoing]:
        """The fleet's routers changed (one registered late): every router's backend, this one's included.
        Each replica known here is told (Routers); its links join the routers they lack, and a replica
        whose hello comes later is told then (register)."""
        self.router_backends = list(backends)
        if len(self.router_backends) < 2:
            return []
        message = Routers(backends=list(self.router_backends))
        return [Outgoing(REPLICA, replica_id.encode(), message) for replica_id in self.replicas]

    def _unregister(self, replica_id: str) -> Optional[ReplicaEntry]:
        entry = self.replicas.pop(replica_id, None)
        if entry is None:
            return None
        for pool in self._pools_of(entry):
            pool.remove(replica_id)
        self.unavailable.discard(replica_id)
        self.open_breakers.discard(replica_id)
        self.policy.forget(replica_id)
        return entry

    def _pools_of(self, entry: ReplicaEntry) -> list[ReplicaPool]:
        model = entry.load.model
        return [p for p in (self.pools.get(model), self.version_pools.get((model, entry.version))) if p is not None]

    @property
    def follows_kv_events(self) -> bool:
        """Whether the router should subscribe to the replicas' KV events (precise prefix routing)."""
        return self.policy.follows_kv_events

    def on_kv_events(self, replica_id: str, events: list) -> None:
        """KV events of a replica's engine (precise prefix routing); ignored for unknown replicas."""
        if replica_id in self.replicas and self.policy.follows_kv_events:
            self.policy.on_kv_events(replica_id, events)

    def replica_lost(self, replica_id: str, cause: str, now: float, expected: bool = False) -> list[Outgoing]:
        """Drop a replica from rotation and move its in-flight requests elsewhere."""
        return self._lose([(replica_id, cause)], now, expected)

    def _lose(self, lost: list[tuple[str, str]], now: float, expected: bool = False) -> list[Outgoing]:
        """Drop every replica of `lost` (id, cause) from rotation first, then move their in-flight requests:
        a retry must not land on another replica lost at the same moment (a node's replicas fall silent
        together) and spend one of the request's attempts on it."""
        gone = []
        for replica_id, cause in lost:
            if self._unregister(replica_id) is None:
                continue
            log.log(logging.INFO if expected else logging.WARNING, "replica %s out of rotation: %s", replica_id, cause)
            gone.append((replica_id, cause))
        out: list[Outgoing] = []
        causes = dict(gone)  # one pass over the requests in flight, not one per lost replica (a fault group)
        for entry in [e for e in self.inflight.values() if e.replica_id in causes] if causes else ():
            out += self._retry(entry, f"replica {entry.replica_id} lost: {causes[entry.replica_id]}", now)
        return out

    def drain(self, replica_id: str) -> list[Outgoing]:
        """Stop sending new work to a replica; it leaves when its requests finish."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            return []
        entry.draining = True
        self.unavailable.add(replica_id)
        return [Outgoing(REPLICA, replica_id.encode(), Drain())]

    # ---------------------------------------------------------------- time

    def tick(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for replica_id in list(self.open_breakers):  # cool-off over: half-open, one probe may go
            self._refresh(replica_id, now)
        heard_after = now - self.settings.replica_expiry  # one comparison a replica: 3,072 of them each tick
        out += self._lose([(r, f"silent for {now - e.last_seen:.1f}s")
                           for r, e in self.replicas.items() if e.last_seen < heard_after], now)
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
            elif entry.replica_id and not entry.first_token_at \
                    and now - entry.dispatched_at > self.settings.first_token_timeout:
                out += self._replica_failed(entry, f"no first token from {entry.replica_id} within "
                                                   f"{self.settings.first_token_timeout:.0f}s", now)
            elif entry.replica_id and entry.first_token_at \
                    and now - entry.last_token_at > self.settings.stall_limit:
                out += self._replica_failed(entry, f"stream from {entry.replica_id} stalled for "
                                                   f"{now - entry.last_token_at:.0f}s", now)
        return out + self._drain_pending(now)

    # ---------------------------------------------------------------- status

    def snapshot(self) -> dict:
        replicas = self.replicas.values()
        return {
            "replicas": [
                {"replica_id": rid, "model": e.load.model, "version": e.version, "node": e.node, "pid": e.pid,
                 "outstanding": e.load.outstanding, "queue_depth": e.load.queue_depth,
                 "draining": e.draining, "breaker": e.breaker.state.value if e.breaker else "closed",
                 "prefix_hit_tokens": e.prefix_hit_tokens, "prefix_query_tokens": e.prefix_query_tokens,
                 "kv_blocks_cached": e.kv_blocks_cached, "kv_used": e.load.kv_used,
                 "latency_ewma_ms": e.load.latency_ewma_ms, "running": e.running,
                 "requests_finished": e.requests_finished, "tokens_generated": e.tokens_generated,
                 "ttft_ms_p50": e.latency_ms[0], "ttft_ms_p99": e.latency_ms[1], "tpot_ms_p50": e.latency_ms[2],
                 "tpot_ms_p99": e.latency_ms[3]}
                for rid, e in sorted(self.replicas.items())
            ],
            # Over the replicas in rotation, as their engines report them: the fleet's prefix-cache hit rate.
            "prefix_hit_tokens": sum(e.prefix_hit_tokens for e in replicas),
            "prefix_query_tokens": sum(e.prefix_query_tokens for e in replicas),
            "inflight": len(self.inflight),
            "pending": len(self.pending),
            "pending_by_model": self._pending_by_model(),
            "routing": dict(self.reasons),
            "rollouts": self.rollouts.snapshot(),
            **self.counters,
        }

    # ---------------------------------------------------------------- internals

    def _pending_by_model(self) -> dict[str, int]:
        """Requests waiting for a replica, per model: the demand of a model with none serving."""
        counts: dict[str, int] = {}
        for request_id in self.pending:
            entry = self.inflight.get(request_id)
            if entry is not None:
                counts[entry.request.model] = counts.get(entry.request.model, 0) + 1
        return counts

    def _candidates(self, entry: Inflight) -> ReplicaPool:
        model = entry.request.model
        if not entry.version_chosen:
            # No rollout anywhere (the usual case): no call to find that out, once per request.
            entry.version = self.rollouts.select(model, entry.request, self.version_pools) \
                if self.rollouts.rollouts else None
            entry.version_chosen = True
        if entry.version is not None:
            pool = self.version_pools.get((model, entry.version))
            # The chosen version while one of its replicas can take the request; else any version:
            # a canary whose replicas are all broken or already tried must not hold requests back, and
            # if the stable version's are, its requests may go to the canary rather than wait or fail.
            if pool and any(r.replica_id not in self.unavailable and r.replica_id not in entry.tried for r in pool):
                return pool
        pool = self.pools.get(model)  # not `or`: that calls the pool's __len__ in Python
        return pool if pool is not None else ReplicaPool()

    def _route(self, candidates: ReplicaPool, exclude, key: Optional[RoutingKey]) -> tuple[Optional[str], int]:
        decision = self.policy.route(candidates, exclude, key)
        if decision.replica_id is not None:
            self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
            self.policy.commit(decision, key)
        return decision.replica_id, decision.matched_blocks

    def _dispatch(self, entry: Inflight, now: float) -> list[Outgoing]:
        request = entry.request
        if entry.key is None and self._uses_prefix:
            hashes, scheme = request.prefix_hashes, request.prefix_scheme
            if request.hashes_packed:  # as gateways send them (protocol.pack_request)
                hashes, scheme = unpack_hashes(request.hashes_packed, scheme)
            entry.key = self.policy.routing_key(entry.prompt, hashes, scheme)
        candidates = self._candidates(entry)
        # A first attempt has tried nothing: the set itself, whose `in` costs no Python call.
        exclude = _Excluded(entry.tried, self.unavailable) if entry.tried else self.unavailable
        replica_id, matched = self._route(candidates, exclude, entry.key)
        if replica_id is None and entry.tried:
            # Every replica was tried once; a second go on a healthy one beats failing.
            replica_id, matched = self._route(candidates, self.unavailable, entry.key)
        if replica_id is None:
            if request.request_id not in self.pending:
                self.pending.append(request.request_id)
            return []
        replica = self.replicas[replica_id]
        load, key, sent = replica.load, entry.key, len(entry.sent_tokens)
        entry.replica_id = replica_id
        entry.dispatched_at = now
        entry.first_token_at = 0.0
        entry.attempts += 1
        entry.tried.add(replica_id)
        if entry.attempts > 1:  # a resend: its own replica-side id (attempt_id)
            entry.wire_id = attempt_id(request.request_id, entry.attempts)
            self.attempts[entry.wire_id] = request.request_id
        load.outstanding += 1
        shift_prefilling(load, replica.pools, 1)  # until its first token (the bounded-load cap's count)
        # Comparisons rather than max() here and in _release: this runs for every request.
        prefill = entry.prompt_len + sent - (matched * key.block_size if key is not None else 0)
        entry.prefill_estimate = prefill = prefill if prefill > 0 else 0
        load.prefill_tokens += prefill
        entry.decode_estimate = decode = request.max_tokens - sent
        load.decode_tokens += decode  # for the token-aware least-load baseline
        if replica.breaker.state is BreakerState.HALF_OPEN:
            replica.breaker.on_dispatch()  # this request is the probe; no other until it answers
            self.unavailable.add(replica_id)
        if not sent and entry.raw is not None and not entry.wire_id:
            return [Outgoing(REPLICA, replica_id.encode(), entry.raw)]  # as the gateway encoded it
        to_send = request if not sent and type(request) is GenerateRequest and not entry.wire_id else GenerateRequest(
            request_id=entry.wire_id or request.request_id, model=request.model,
            prompt_token_ids=list(request.prompt_token_ids) + entry.sent_tokens,
            max_tokens=request.max_tokens - sent, temperature=request.temperature, top_p=request.top_p,
            seed=request.seed, timeout=request.timeout, quota_group=request.quota_group, resumed_tokens=sent,
            stop_token_ids=request.stop_token_ids)
        return [Outgoing(REPLICA, replica_id.encode(), to_send)]

    def _drain_pending(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for _ in range(len(self.pending)):
            entry = self.inflight.get(self.pending.popleft())
            if entry is not None:
                out += self._dispatch(entry, now)  # re-queues itself when no replica can take it
        return out

    def _on_chunk(self, replica_id: str, chunk: TokenChunk, now: float) -> list[Outgoing]:
        entry = self.inflight.get(chunk.request_id)
        if entry is None and self.attempts:
            entry = self.inflight.get(self.attempts.get(chunk.request_id, ""))
        if entry is None or entry.replica_id != replica_id or chunk.request_id != (entry.wire_id
                                                                                  or entry.request.request_id):
            return []  # late chunk from a replica, or an attempt, we already moved away from
        if not entry.first_token_at:
            self._first_token(entry, now)
        entry.last_token_at = now
        entry.sent_tokens.extend(chunk.token_ids)
        forwarded = TokenChunk(
            request_id=entry.request.request_id, token_ids=chunk.token_ids, finished=chunk.finished,
            finish_reason=chunk.finish_reason, prompt_tokens=entry.prompt_len,
            completion_tokens=len(entry.sent_tokens), replica_id=replica_id)
        out = [Outgoing(GATEWAY, entry.gateway, forwarded)]
        if chunk.finished:
            self.inflight.pop(entry.request.request_id)
            self.counters["completed"] += 1
            out += self._release(entry, abort=False)
        return out

    def _on_replica_error(self, replica_id: str, error: RequestError, now: float) -> list[Outgoing]:
        entry = self.inflight.get(error.request_id)
        if entry is None and self.attempts:
            entry = self.inflight.get(self.attempts.get(error.request_id, ""))
        if entry is None or entry.replica_id != replica_id or error.request_id != (entry.wire_id
                                                                                  or entry.request.request_id):
            return []
        if 400 <= error.status < 500 and "already in flight" in error.message:
            # The replica still runs an attempt under this id: our fault, never the client's (no 4xx for it);
            # tell it to drop that one and try again (on another replica if there is one).
            return self._replica_failed(entry, f"replica {replica_id}: {error.message}", now)
        if 400 <= error.status < 500:  # the request itself is bad: another replica won't help
            return self._fail(entry, error.status, error.code, error.message)
        if error.code in ("draining", "drain_timeout"):  # leaving, not failing: no breaker count
            return self._retry(entry, f"replica {replica_id}: {error.message}", now)
        return self._replica_failed(entry, f"replica {replica_id}: {error.message}", now)

    # ---------------------------------------------------------------- breakers

    def _first_token(self, entry: Inflight, now: float) -> None:
        entry.first_token_at = now
        replica = self.replicas.get(entry.replica_id)
        if replica is None:
            return
        left = replica.load.prefill_tokens - entry.prefill_estimate
        replica.load.prefill_tokens = left if left > 0 else 0
        entry.prefill_estimate = 0
        shift_prefilling(replica.load, replica.pools, -1)
        if replica.breaker.state is not BreakerState.CLOSED or replica.breaker.consecutive_failures:
            replica.breaker.on_success()
            self._refresh(entry.replica_id, now)

    def _replica_failed(self, entry: Inflight, cause: str, now: float) -> list[Outgoing]:
        """The replica failed this request: count it against its breaker, then retry elsewhere."""
        replica = self.replicas.get(entry.replica_id)
        if replica is not None and replica.breaker.on_failure(now):
            self.counters["breaker_opened"] += 1
            log.warning("breaker open for replica %s for %.0fs: %s", entry.replica_id, replica.breaker.cooloff, cause)
            self._refresh(entry.replica_id, now)
        return self._retry(entry, cause, now)

    def _refresh(self, replica_id: str, now: float) -> None:
        """Recompute whether a replica takes new work (draining, breaker)."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        breaker = replica.breaker
        if breaker.state is BreakerState.OPEN and now < breaker.reopens_at():
            self.open_breakers.add(replica_id)
        else:
            self.open_breakers.discard(replica_id)
        if replica.draining or not breaker.available(now):
            self.unavailable.add(replica_id)
        else:
            self.unavailable.discard(replica_id)

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
                prompt_tokens=entry.prompt_len, completion_tokens=len(entry.sent_tokens)))]
        self.counters["retries"] += 1
        log.info("retrying %s after %d token(s): %s", entry.request.request_id, len(entry.sent_tokens), cause,
                 extra={"request_id": entry.request.request_id})
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
            load = replica.load
            left = load.outstanding - 1
            load.outstanding = left if left > 0 else 0
            left = load.prefill_tokens - entry.prefill_estimate
            load.prefill_tokens = left if left > 0 else 0
            left = load.decode_tokens - entry.decode_estimate
            load.decode_tokens = left if left > 0 else 0
            if not entry.first_token_at:  # ended before its first token (a first token already counted it off)
                shift_prefilling(load, replica.pools, -1)
            if replica.breaker.probe_in_flight and not entry.first_token_at:
                replica.breaker.probe_in_flight = False  # the probe ended without a verdict: allow another
                if not replica.draining:
                    self.unavailable.discard(entry.replica_id)
        if abort:
            # Also to a replica already out of rotation (lost, expired): it may well still run the attempt (a
            # false loss, a stall), and its work must stop once the request moved. A socket that is gone
            # refuses the send (EHOSTUNREACH), which loses nothing.
            out.append(Outgoing(REPLICA, entry.replica_id.encode(),
                                Abort(request_id=entry.wire_id or entry.request.request_id)))
        if entry.wire_id:
            self.attempts.pop(entry.wire_id, None)
        entry.prefill_estimate = entry.decode_estimate = 0
        return out

    @staticmethod
    def _error_to(gateway: bytes, request_id: str, status: int, code: str, message: str) -> Outgoing:
        retry_after = 1.0 if status in (429, 503) else 0.0
        return Outgoing(GATEWAY, gateway, RequestError(request_id=request_id, status=status, code=code,
                                                       message=message, retry_after=retry_after))
