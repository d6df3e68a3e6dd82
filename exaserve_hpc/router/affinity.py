"""Prefix-affinity routing: send a prompt where its prefix is cached, unless that replica is overloaded.

For each request the policy compares a few candidates by an estimate of the
time to first token, in prefill-token units:

    own  = uncached x (1 + pair_tokens x (cached + uncached / 2)) + base_tokens
           (this prompt's uncached tokens there, attention's quadratic term included)
    cost = (prefill tokens queued there + own)
           x (1 + decode_share x requests running there)       # decodes slow every step
           + queue_tokens x requests beyond its batch size       # waiting for a batch slot
           then x (1 + kv_weight x KV use)

All the prefill work queued at a replica counts as ahead of the prompt: the engines admit requests in
arrival order as KV room and batch slots free up (TensorRT-LLM reserves a request's whole KV at admission),
so the prompts there are not all in prefill together sharing each step. An earlier form capped that work
at (requests running x a chunk) on the assumption that they were; measured as deployed
(bench_router_trace, small16-a100's 8B, 1,000 conversation requests, 3 seeds) it cost 11-69% mean TTFT
at 70-95% load, the latency factor included.

The replica's reported latency (its step-time EWMA) is not in the cost by default (``weights.latency_cap``
1: no factor). A step's time is mostly the work the replica holds, which the queued tokens already
count, so a replica busy with a long prefill counted as slow twice and lost its cache affinity; a replica
that is slow for another reason (a throttled GPU, a slow node) keeps its requests longer, so its router-side
counts of outstanding prefill tokens and requests grow and it costs more through them.

The constants are the timing model's, not tuned (`AffinitySettings.from_timings`,
what bench_router_trace uses): base_tokens = one step's overhead, pair_tokens =
the attention pair's cost, decode_share = one running sequence's share of a
prefill step (its GEMM row and its K/V read at the mean context), all in
prefill-token units.

The candidates are the replicas holding the longest cached prefix (from the
`PrefixIndex`, a handful at most) and a random draw of ``weights.samples``
replicas (4; every replica of a pool of at most ``compare_all_up_to``, 32), each credited with the prefix the index says it holds (a
bounded binary search of that replica's entries). So imbalance is judged
among the candidates, never fleet-wide, and a decision costs the same with
16 replicas or 3,072.

Branches (the `Decision.reason`, counted by the dispatcher):
- ``affinity``: a replica with a cached prefix was cheapest;
- ``spill``: replicas hold the prefix but all cost more than a fresh one;
  the request goes elsewhere and that replica becomes a holder too, which is
  how a very hot prefix spreads over more replicas;
- ``balance``: nothing cached anywhere (or the match is below
  ``min_match_blocks``): plain load-weighted choice;
- ``bounded``: the cheapest candidate would go past the load bound
  (``max_load_factor``, "consistent hashing with bounded loads", Mirrokni,
  Thorup and Zadimoghaddam 2016, as HAProxy's hash-balance-factor): a
  replica whose requests before their first token (`ReplicaLoad.prefilling`)
  would exceed max(1, factor x the pool's mean of them, this request
  included) is passed over for the cheapest candidate within the bound, or
  the least loaded when none is. The cost model prices a queue, but a hot
  prefix still piles onto its holders when every alternative is costlier by
  its uncached tokens; the bound caps that pile whatever the costs say. The
  mean is the pool's running sum over its size: O(1), no scan.

Where the index comes from (``router.prefix_mode``): ``approximate``, the
router's own decisions (`commit`); ``precise``, the engines' KV events only
(the router subscribes to each replica's publisher, `on_kv_events`), hashed
as the engine hashes, so an evicted prefix stops attracting requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Container, Optional, Sequence

from exaserve_hpc.router.balancing import (  # noqa: F401 - Decision is re-exported: callers know it as affinity's
    Decision, PowerOfTwo, ReplicaLoad, ReplicaPool, RoutingKey, RoutingPolicy, WeightSettings, mean_latency_ms,
)
from exaserve_hpc.engine.kv_events import BlockStored
from exaserve_hpc.router.prefix_index import EngineBlockHasher, FastBlockHasher, PrefixIndex, make_index

try:  # `route` compiled (same decisions); built with the compiled prefix index, absent where that is
    from exaserve_hpc.router._affinity_route import route as compiled_route
except ImportError:  # not built: `route` below serves (prefix_index.make_index logs the missing build)
    compiled_route = None

log = logging.getLogger(__name__)
APPROXIMATE, PRECISE = "approximate", "precise"


@dataclass
class AffinitySettings:
    mode: str = APPROXIMATE  # PRECISE: hash like the engine and apply its KV events
    block_size: int = 16  # tokens per block; in precise mode the engine's block size
    max_prompt_blocks: int = 1024  # blocks hashed per prompt (bounds work on huge prompts)
    index_blocks: int = 1_000_000  # block hashes the index keeps (memory bound)
    min_match_blocks: int = 1
    base_tokens: float = 64.0  # fixed cost of any request, so equal-load ties go to balance
    decode_share: float = 0.03  # each running request slows a prefill step by this fraction
    queue_tokens: float = 8192.0  # a request waiting for a batch slot, in prefill tokens
    pair_tokens: float = 0.0  # cost of one causal (query, key) attention pair, in prefill tokens
    # Cached-prefix candidates considered per request (the index's newest holders). 8: at 3,072 replicas
    # (bench_router_scaleout_sim --compare-all, exa256-mix) 4 left the draw 1.115x the mean TTFT of comparing
    # every replica, a hot prefix's 4 newest holders being busy while older ones idled; 8 gave 1.04x, 12 and
    # 16 no better.
    matches: int = 8
    # Bounded loads: a replica whose requests before their first token would exceed max(1, this x the pool's
    # mean of them, this request included) is not chosen while a candidate within it is; 0: no cap. Off by
    # default: in bench_router_trace (Mooncake 3,000 and the tenant trace, 70-95% load) every factor tried
    # (1.5-4) raised mean TTFT (Mooncake at 95%: 0.70 s -> 0.72/0.76 s at 3/2) by giving up cache hits, while
    # it cut the time some replica's queue spent above 3x the mean (29% -> 16/6% of reports).
    max_load_factor: float = 0.0
    # 4 drawn candidates besides the holders: in bench_router_trace (h200, 4,000 requests) 2 cost 3-6% mean TTFT.
    # latency_cap 1: the replicas' step-time EWMA does not scale the cost (the module docstring says why; in
    # bench_router_trace it cost 3-19% mean TTFT at 70-95% load, as deployed)
    weights: WeightSettings = field(default_factory=lambda: WeightSettings(samples=4, latency_cap=1.0))
    # A pool this small is compared whole instead of drawn from: on the Mooncake trace (3,000 requests, 16 h200
    # replicas, the honest timing model) every replica compared gave 2-6% lower mean TTFT than 4 drawn, at
    # 70/85/95% load and under each of 3 seeds, because a draw of 4 often misses the one least-loaded replica.
    # Compiled, a decision at 32 replicas compared whole takes about 8 us against 4 us drawn (1 us more at 16);
    # at thousands of replicas the draw keeps the decision's cost flat.
    compare_all_up_to: int = 32

    @classmethod
    def from_site(cls, router) -> "AffinitySettings":
        """From a site config's router section (config.RouterConfig)."""
        return cls(mode=router.prefix_mode, block_size=router.block_size, index_blocks=router.index_blocks,
                   max_load_factor=router.max_load_factor)

    @classmethod
    def from_timings(cls, timings, step_tokens: int, mean_context_tokens: float, **overrides) -> "AffinitySettings":
        """Cost constants from a timing model (engine/timing.py `GpuTimings`), in prefill-token units.

        ``step_tokens``: the engines' per-step token budget (a step that prefills costs its overhead
        plus that many tokens); ``mean_context_tokens``: K/V tokens a decoding sequence reads, on
        average (the workload's, or the replicas' reported kv_tokens / running).
        """
        per_token = timings.prefill_per_token_s
        step = timings.step_overhead_s + step_tokens * per_token
        decode = timings.decode_per_seq_s + timings.kv_read_per_token_s * mean_context_tokens
        values = dict(base_tokens=timings.step_overhead_s / per_token, decode_share=decode / step,
                      pair_tokens=timings.prefill_per_pair_s / per_token)
        return cls(**{**values, **overrides})

    def hasher(self) -> "FastBlockHasher | EngineBlockHasher":
        return prompt_hasher(self.mode, self.block_size, self.max_prompt_blocks)

    def __post_init__(self) -> None:
        if self.mode not in (APPROXIMATE, PRECISE):
            raise ValueError(f"prefix affinity mode {self.mode!r} is unknown; choose {APPROXIMATE} or {PRECISE}")
        if self.max_load_factor != 0 and not self.max_load_factor >= 1:  # `not >=`: NaN refused too
            raise ValueError(f"max_load_factor {self.max_load_factor!r} is out of range; choose 0 (no cap) "
                             f"or a factor of at least 1")


def prompt_hasher(mode: str, block_size: int, max_blocks: int = 1024) -> FastBlockHasher | EngineBlockHasher:
    """The block hasher of a router in ``mode``; gateways use it to hash prompts for the router."""
    return (EngineBlockHasher if mode == PRECISE else FastBlockHasher)(block_size, max_blocks)


class PrefixAffinity(RoutingPolicy):
    name = "prefix_affinity"
    uses_prefix = True

    @classmethod
    def from_site(cls, router, batching) -> "PrefixAffinity":
        return cls(AffinitySettings.from_site(router))

    @classmethod
    def prompt_hasher(cls, router) -> "FastBlockHasher | EngineBlockHasher":
        return AffinitySettings.from_site(router).hasher()

    def __init__(self, settings: Optional[AffinitySettings] = None, seed: Optional[int] = None,
                 compiled: bool = True, **overrides):
        """``compiled=False``: the pure-Python index and `route` (the reference) even where the compiled
        ones are built; else they serve where built (prefix_index.make_index, _affinity_route.pyx)."""
        self.settings = settings or AffinitySettings(**overrides)
        s = self.settings
        self.index = make_index(max_blocks=s.index_blocks, compiled=compiled)
        self._compiled_route = compiled_route if compiled and not isinstance(self.index, PrefixIndex) else None
        self.hasher = s.hasher()
        self.balance = PowerOfTwo(s.weights, seed=seed)
        self._block_size_checked = False  # the engines' block size is checked once, on their first event

    # ---------------------------------------------------------------- hooks

    def routing_key(self, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (),
                    scheme: str = "") -> RoutingKey:
        """The prompt's block hashes: ``hashes`` if the gateway computed them our way, else our own."""
        n, hasher = len(prompt_token_ids), self.hasher
        if hashes and scheme == hasher.scheme:
            blocks = n // hasher.block_size  # hasher.blocks(n) without its call: once per request
            if len(hashes) == (blocks if blocks < hasher.max_blocks else hasher.max_blocks):
                return RoutingKey(hashes, n, self.settings.block_size)
        return RoutingKey(hasher(prompt_token_ids), n, self.settings.block_size)

    @property
    def follows_kv_events(self) -> bool:
        return self.settings.mode == PRECISE

    def forget(self, replica_id: str) -> None:
        self.index.forget(replica_id)

    def on_kv_events(self, replica_id: str, events: list) -> None:
        if not self._block_size_checked:
            stored = next((e for e in events if isinstance(e, BlockStored)), None)
            if stored is not None:
                self._block_size_checked = True
                if stored.block_size != self.settings.block_size:
                    log.warning("replica %s caches blocks of %d tokens but router.block_size is %d: precise prefix "
                                "routing will find no match; set router.block_size to %d", replica_id,
                                stored.block_size, self.settings.block_size, stored.block_size)
        self.index.apply_events(replica_id, events)

    # ---------------------------------------------------------------- choice

    def cost(self, c: ReplicaLoad, uncached: int, mean_latency: float, prompt: int = 0) -> float:
        # Comparisons instead of min()/max(): this runs for every candidate of every request.
        s = self.settings
        own = uncached + s.base_tokens
        if s.pair_tokens:  # attention: each uncached token attends to the cached ones and half the rest
            own += s.pair_tokens * uncached * (prompt - uncached + uncached / 2 if prompt > uncached else uncached / 2)
        running = c.outstanding if c.outstanding >= c.queue_depth else c.queue_depth
        # All the prefill work queued there is ahead of this prompt: prompts wait for KV room and batch
        # slots in arrival order, so they are not all in prefill at once sharing each step (see the docstring).
        cost = (c.prefill_tokens + own) * (1.0 + s.decode_share * running)
        if running >= c.max_batch_size:
            cost += s.queue_tokens * (running + 1 - c.max_batch_size)
        w = s.weights
        if mean_latency > 0 and c.latency_ewma_ms > 0:
            slow, cap = c.latency_ewma_ms / mean_latency, w.latency_cap  # clamped to [1 / cap, cap]
            cost *= cap if slow > cap else (1.0 / cap if slow * cap < 1.0 else slow)
        return cost * (1.0 + w.kv_weight * c.kv_used)

    def _held(self, replica_id: str, hashes: Sequence[int], deepest: int) -> int:
        """Leading blocks of ``hashes`` (at most ``deepest``) the index says ``replica_id`` holds.

        A replica's entries are prefix-closed (a prompt's blocks are recorded together), so this
        is a binary search: O(log deepest) lookups, one when it lacks even the first block.
        """
        depth = self.index.held(replica_id, hashes, deepest)
        return depth if depth >= self.settings.min_match_blocks else 0

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        # The hot path of every request: `cost` is called inline-free through a local, the
        # candidate list is built without intermediate lists (profiled: half of `route` was
        # list/dict building and attribute lookups, not the policy). Compiled where built: this
        # method is then the reference it is tested against, and serves plain candidate lists.
        if self._compiled_route is not None and candidates.__class__ is ReplicaPool:
            return self._compiled_route(self, candidates, exclude, key)
        s = self.settings
        matches: list[tuple[str, int]] = []
        pool = candidates if isinstance(candidates, ReplicaPool) else None
        if key is not None and key.block_hashes:
            allowed = pool if pool is not None else {c.replica_id for c in candidates}
            matches = self.index.match(key.block_hashes, allowed, exclude, limit=s.matches)
            if s.min_match_blocks > 1:
                matches = [(r, d) for r, d in matches if d >= s.min_match_blocks]
        n = len(candidates)
        drawn = self.balance.sample(candidates, exclude, n if n <= s.compare_all_up_to else s.weights.samples)
        if not matches and not drawn:
            return Decision(None, reason="none")
        prompt = key.prompt_tokens if key is not None else 0
        size = key.block_size if key is not None else s.block_size
        mean = mean_latency_ms(candidates)
        cost = self.cost
        bound = self._load_bound(candidates, pool) if s.max_load_factor else 0.0
        scored: list = []  # (rank, candidate, depth) of each candidate, kept only under a load bound
        best, best_depth, best_rank = None, 0, None
        deepest, matched = 0, ()
        if matches:
            lookup = pool.get if pool is not None else {c.replica_id: c for c in candidates}.get
            matched = set()
            for r, depth in matches:
                matched.add(r)
                if depth > deepest:
                    deepest = depth
                c = lookup(r)
                rank = (cost(c, max(0, prompt - depth * size), mean, prompt), -depth, r)
                if bound:
                    scored.append((rank, c, depth))
                if best_rank is None or rank < best_rank:
                    best, best_depth, best_rank = c, depth, rank
        held, hashes = self._held, key.block_hashes if deepest else ()
        for c in drawn:
            r = c.replica_id
            if r in matched:
                continue
            # A drawn replica may hold the prefix too (matches are only its newest holders).
            depth = held(r, hashes, deepest) if deepest else 0
            rank = (cost(c, prompt - depth * size if depth else prompt, mean, prompt), -depth, r)
            if bound:
                scored.append((rank, c, depth))
            if best_rank is None or rank < best_rank:
                best, best_depth, best_rank = c, depth, rank
        reason = "affinity" if best_depth else ("spill" if matches else "balance")
        if bound and best.prefilling + 1 > bound:
            # The cheapest would go past the bound: the cheapest within it, else the least loaded (never none).
            within = [x for x in scored if x[1].prefilling + 1 <= bound]
            _, best, best_depth = min(within) if within else min(scored, key=lambda x: (x[1].prefilling, x[0]))
            reason = "bounded"
        elif reason == "balance" and len(drawn) > 1 and self.balance.rng.random() < s.weights.explore:
            best = max((c for c in drawn if not bound or c.prefilling + 1 <= bound),  # the probe share
                       key=lambda c: (cost(c, prompt, mean, prompt), c.replica_id))
        return Decision(best.replica_id, best_depth, reason)

    def _load_bound(self, candidates: Sequence[ReplicaLoad], pool: Optional[ReplicaPool]) -> float:
        """The most requests before their first token a replica may hold once this one is sent there:
        max(1, max_load_factor x the mean over the pool, this request counted). O(1) for a pool (its
        running sum); a plain list (tests) is summed."""
        if pool is not None:
            total, n = pool.prefilling_sum, len(pool.members)
        else:
            total, n = sum(c.prefilling for c in candidates), len(candidates)
        bound = self.settings.max_load_factor * (total + 1) / n
        return bound if bound > 1.0 else 1.0

    def commit(self, decision: Decision, key: Optional[RoutingKey]) -> None:
        """Approximate mode: the request went where `route` said, so that replica now (probably)
        holds its prefix. Precise mode records nothing here: the index is what the engines said
        they store and evict, not what the router hopes.

        Separate from `route` so the dispatcher can send the request first.
        """
        if decision.replica_id is not None and key is not None and key.block_hashes \
                and self.settings.mode != PRECISE:
            self.index.record(decision.replica_id, key.block_hashes, decision.matched_blocks)
