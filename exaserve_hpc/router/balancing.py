"""Which replica takes a request: pure policies over a snapshot of replica load.

A policy sees only `ReplicaLoad` values (no sockets, no clock) and returns a
`Decision` (a replica id, or None when no candidate can take the request).
The router keeps the snapshot current from replica stats and its own
outstanding counts.

Every policy is a `RoutingPolicy`; its docstring is the call protocol the
dispatcher follows. ``candidates`` is a `ReplicaPool` (the router's per-model
registry: O(1) random access and running sums, so a choice never costs work
proportional to the fleet) or a plain list in tests; ``exclude`` is any
container of replica ids that must not be chosen (tried already, draining,
breaker open); ``key`` is the request's `RoutingKey` (prompt block hashes)
or None. `router/policies.py` holds the table of policies by name and the
one factory.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Container, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from exaserve_hpc.config.schema import BatchingConfig, RouterConfig


@dataclass(slots=True)  # slots: read on every routing decision
class ReplicaLoad:
    replica_id: str
    model: str
    outstanding: int  # requests the router has sent and not seen finish
    max_batch_size: int
    queue_depth: int = 0  # as last reported by the replica
    kv_used: float = 0.0
    latency_ewma_ms: float = 0.0
    prefill_tokens: int = 0  # router-side estimate: uncached prompt tokens sent and not yet past first token
    decode_tokens: int = 0  # router-side: max_tokens of the requests sent and not yet finished
    # router-side: requests sent and not yet at their first token (waiting there or in prefill); change it
    # with `shift_prefilling`, which keeps the pools' sums (the bounded-load cap's mean) in step
    prefilling: int = 0

    @property
    def load(self) -> float:
        """Fraction of batch capacity in use; above 1.0 requests queue at the replica."""
        return max(self.outstanding, self.queue_depth) / max(1, self.max_batch_size)


@dataclass(slots=True)
class RoutingKey:
    """What a prefix-aware policy knows of a request's prompt."""

    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks, in order (a list, or an array from a packed request)
    prompt_tokens: int
    block_size: int


def hashed_key(hasher, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (), scheme: str = "") -> RoutingKey:
    """A prompt's `RoutingKey` under ``hasher`` (router/prefix_index.py's hashers): the gateway's ``hashes`` when
    it hashed the prompt that way (same scheme, as many blocks), else the hasher's own. The routing_key of a
    policy that hashes prompts; prefix affinity inlines the same on its hot path."""
    n = len(prompt_token_ids)
    if hashes and scheme == hasher.scheme and len(hashes) == hasher.blocks(n):
        return RoutingKey(hashes, n, hasher.block_size)
    return RoutingKey(hasher(prompt_token_ids), n, hasher.block_size)


class ReplicaPool:
    """The replicas of one model: random access, O(1) add/remove, running sums of latency and of
    requests before their first token (so a policy reads the pool's means without a scan)."""

    def __init__(self) -> None:
        self._items: list[ReplicaLoad] = []
        self._pos: dict[str, int] = {}
        self.latency_sum_ms = 0.0
        self.prefilling_sum = 0  # of the members' `prefilling`: kept by add/remove and `shift_prefilling`
        # The same list object for the pool's lifetime (removal swaps in place), so a policy may
        # index it directly: `pool[i]` through __getitem__ costs a Python call per draw.
        self.members = self._items

    def add(self, load: ReplicaLoad) -> None:
        if load.replica_id in self._pos:
            self.remove(load.replica_id)
        self._pos[load.replica_id] = len(self._items)
        self._items.append(load)
        self.latency_sum_ms += load.latency_ewma_ms
        self.prefilling_sum += load.prefilling

    def remove(self, replica_id: str) -> None:
        index = self._pos.pop(replica_id, None)
        if index is None:
            return
        gone, last = self._items[index], self._items.pop()
        self.latency_sum_ms -= gone.latency_ewma_ms
        self.prefilling_sum -= gone.prefilling
        if last is not gone:
            self._items[index] = last
            self._pos[last.replica_id] = index

    def set_latency(self, load: ReplicaLoad, latency_ms: float) -> None:
        set_latency(load, [self] if load.replica_id in self._pos else [], latency_ms)

    def get(self, replica_id: str) -> Optional[ReplicaLoad]:
        index = self._pos.get(replica_id)
        return None if index is None else self._items[index]

    @property
    def mean_prefilling(self) -> float:
        return self.prefilling_sum / len(self._items) if self._items else 0.0

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_sum_ms / len(self._items) if self._items else 0.0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> ReplicaLoad:
        return self._items[index]

    def __iter__(self) -> Iterator[ReplicaLoad]:
        return iter(self._items)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._pos


def shift_prefilling(load: ReplicaLoad, pools: Sequence[ReplicaPool], delta: int) -> None:
    """Change a replica's count of requests before their first token by ``delta`` (never below 0), and
    the sum of every pool it is in (``pools``: all of them, or the sums drift) by as much. O(1): the
    dispatcher calls it when a request is sent, reaches its first token, or ends before it."""
    value = load.prefilling + delta
    if value < 0:  # a request of the replica's previous life (it re-registered under its id) ending
        value = 0
    delta = value - load.prefilling
    if delta:
        load.prefilling = value
        for pool in pools:
            pool.prefilling_sum += delta


def set_latency(load: ReplicaLoad, pools: Sequence[ReplicaPool], latency_ms: float) -> None:
    """A replica's reported latency, and the sum of every pool it is in (``pools``: all of them at once: the
    difference is taken before the load changes, so a pool updated after it would miss it)."""
    delta = latency_ms - load.latency_ewma_ms
    for pool in pools:
        pool.latency_sum_ms += delta
    load.latency_ewma_ms = latency_ms


def mean_latency_ms(candidates: Sequence[ReplicaLoad]) -> float:
    if isinstance(candidates, ReplicaPool):
        return candidates.mean_latency_ms
    return sum(c.latency_ewma_ms for c in candidates) / len(candidates) if candidates else 0.0


@dataclass(slots=True)
class Decision:
    """A routing choice; the policy's `commit` records it once the request is sent."""

    replica_id: Optional[str]
    matched_blocks: int = 0  # cached blocks the chosen replica is believed to hold
    reason: str = "balance"  # the policy's branch: affinity | spill | balance | bounded | none


class RoutingPolicy(ABC):
    """What the dispatcher calls, and when.

    - ``routing_key(prompt_token_ids, hashes, scheme)``: once per request, only when
      ``uses_prefix``; ``hashes`` are the gateway's, valid if ``scheme`` is the policy's.
    - ``route(candidates, exclude, key) -> Decision``: for each dispatch attempt; changes
      nothing the next `route` sees except random draws, so a decision can be dropped.
    - ``commit(decision, key)``: the request was sent to ``decision.replica_id``.
    - ``forget(replica_id)``: the replica left rotation (or restarted with a cold cache).
    - ``on_kv_events(replica_id, events)``: its engine's KV events (engine/kv_events.py),
      delivered only when ``follows_kv_events``: the router subscribes to the replicas'
      publishers for such a policy and for no other.
    - ``choose(...)``: route then commit, for callers that send at once (tests, benchmarks).
    """

    name: ClassVar[str]
    uses_prefix: ClassVar[bool] = False  # True: the dispatcher hashes prompts into a RoutingKey for it

    @classmethod
    def from_site(cls, router: "RouterConfig", batching: "BatchingConfig") -> "RoutingPolicy":
        """The policy a site's router section asks for (router.policy names the class)."""
        return cls()

    @classmethod
    def prompt_hasher(cls, router: "RouterConfig"):
        """What gateways hash prompts with for this policy (a callable with ``scheme``), or None: prompts
        are hashed in the gateway processes so the router's one thread only looks the blocks up."""
        return None

    @property
    def follows_kv_events(self) -> bool:
        return False

    def routing_key(self, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (),
                    scheme: str = "") -> Optional[RoutingKey]:
        return None

    @abstractmethod
    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision: ...

    def commit(self, decision: Decision, key: Optional[RoutingKey]) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass

    def on_kv_events(self, replica_id: str, events: list) -> None:
        pass

    def choose(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
               key: Optional[RoutingKey] = None) -> Optional[str]:
        decision = self.route(candidates, exclude, key)
        self.commit(decision, key)
        return decision.replica_id


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        n = len(candidates)
        start = next(self._counter)
        for i in range(n):  # first usable one from the cursor: O(1) unless many are excluded
            c = candidates[(start + i) % n]
            if c.replica_id not in exclude:
                return Decision(c.replica_id)
        return Decision(None, reason="none")


class LeastLoad(RoutingPolicy):
    """Lowest load wins; ties go to lower latency, then to the replica id (deterministic).

    A full scan: the baseline the load-weighted policy is measured against.
    """

    name = "least_load"

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        best: Optional[ReplicaLoad] = None
        for c in candidates:
            if c.replica_id in exclude:
                continue
            if best is None or (c.load, c.kv_used, c.latency_ewma_ms, c.replica_id) < (
                best.load, best.kv_used, best.latency_ewma_ms, best.replica_id
            ):
                best = c
        return Decision(best.replica_id) if best else Decision(None, reason="none")


class LeastTokens(RoutingPolicy):
    """Fewest outstanding tokens wins: prefill tokens not yet past their first token plus the
    decode tokens (max_tokens) of unfinished requests, both as the router counted them; ties go
    to fewer requests, then lower latency, then the replica id.

    The token-aware baseline: a replica with one 30k-token prompt in prefill is not "as loaded"
    as one with a 100-token chat. A full scan, like `LeastLoad`.
    """

    name = "least_tokens"

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        best, best_rank = None, None
        for c in candidates:
            if c.replica_id in exclude:
                continue
            rank = (c.prefill_tokens + c.decode_tokens, max(c.outstanding, c.queue_depth),
                    c.latency_ewma_ms, c.replica_id)
            if best_rank is None or rank < best_rank:
                best, best_rank = c, rank
        return Decision(best.replica_id) if best else Decision(None, reason="none")


@dataclass
class WeightSettings:
    """How reported load turns into a cost (lower is better)."""

    kv_weight: float = 1.0  # cost x (1 + kv_weight * kv_used): a nearly full cache evicts and preempts
    latency_cap: float = 10.0  # a replica counts at most this many times slower than the mean
    explore: float = 0.02  # chance of taking the other sample: a slow replica gets less, never nothing
    samples: int = 2  # power of two choices


def replica_cost(c: ReplicaLoad, mean_latency: float, settings: WeightSettings) -> float:
    """Expected wait in units of "one request on an average replica".

    (work ahead of the request + the request) x how slow this replica is x
    how full its KV cache is. Queue depth counts work the replica holds back
    that the router may not know of (another router, a retry in flight).
    """
    work = max(c.outstanding, c.queue_depth) + 1
    slow = 1.0
    if mean_latency > 0 and c.latency_ewma_ms > 0:
        slow = min(settings.latency_cap, max(1.0 / settings.latency_cap, c.latency_ewma_ms / mean_latency))
    return work * slow * (1.0 + settings.kv_weight * c.kv_used)


class PowerOfTwo(RoutingPolicy):
    """Load-weighted power of two choices.

    Draw two candidates at random, take the one of lower `replica_cost`; with
    probability ``explore`` take the other, so a replica whose reported
    latency is stale-high still gets the probes that let it recover. O(1) per
    choice (plus retries of the draw when many candidates are excluded).
    """

    name = "power_of_two"

    def __init__(self, settings: Optional[WeightSettings] = None, seed: Optional[int] = None):
        self.settings = settings or WeightSettings()
        self.rng = random.Random(seed)

    def sample(self, candidates: Sequence[ReplicaLoad], exclude: Container[str], k: int) -> list[ReplicaLoad]:
        """Up to k distinct usable candidates drawn at random."""
        items = candidates.members if isinstance(candidates, ReplicaPool) else candidates
        n = len(items)
        if n == 0:
            return []
        if k >= n:  # all of them (a small pool compared whole): no draws
            return [c for c in items if c.replica_id not in exclude]
        # randrange(n) inlined (same draws, same stream): its two Python-level calls cost more than the rest.
        getrandbits, bits = self.rng.getrandbits, n.bit_length()
        picked: list[ReplicaLoad] = []
        ids: list[str] = []
        for _ in range(4 * k + 4):
            i = getrandbits(bits)
            while i >= n:
                i = getrandbits(bits)
            c = items[i]
            rid = c.replica_id
            if rid not in exclude and rid not in ids:
                picked.append(c)
                ids.append(rid)
                if len(picked) >= k:
                    return picked
        if len(picked) < n:  # many excluded: scan the rest (rare)
            rest = [c for c in items if c.replica_id not in exclude and c.replica_id not in ids]
            self.rng.shuffle(rest)
            picked += rest[:k - len(picked)]
        return picked

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        drawn = self.sample(candidates, exclude, self.settings.samples)
        if not drawn:
            return Decision(None, reason="none")
        mean = mean_latency_ms(candidates)
        drawn.sort(key=lambda c: (replica_cost(c, mean, self.settings), c.replica_id))
        if len(drawn) > 1 and self.rng.random() < self.settings.explore:
            return Decision(drawn[-1].replica_id)
        return Decision(drawn[0].replica_id)


def candidates_for(model: str, replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    return [r for r in replicas if r.model == model]
