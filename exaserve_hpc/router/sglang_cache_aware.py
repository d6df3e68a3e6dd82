"""`router.policy: sglang_cache_aware`: SGLang's cache-aware router policy, reproduced at block granularity.

Upstream: github.com/sgl-project/sglang, the Rust router (sgl-router/, renamed sgl-model-gateway/), policy
``cache_aware``. Files read:

- ``sgl-model-gateway/src/policies/cache_aware.rs`` (commit b93974f140de1e545d9134d87e77f0bd1fbf3014, after
  PR #14650 "Fix cache-aware router should pick min load instead of min tenant size", merged 2025-12-08);
  ``sgl-router/src/policies/cache_aware.rs`` (commit b6f20641ad6bafc1278db74d1e13b0e9da47bd64, before it);
- ``sgl-model-gateway/src/policies/tree.rs`` (commit 03744dbedc69f4db84d0a6ae6d4400ce252bb6d8): the shared
  multi-tenant approximate radix tree (``insert``, ``prefix_match_with_counts``, ``evict_tenant_by_size``,
  ``remove_tenant``; ``get_smallest_tenant`` in the older sgl-router tree);
- ``sgl-model-gateway/bindings/python/sglang_router/router_args.py`` (commit
  61c660a3c2542cceace53d1cdec520f5009edf8a) and the clap defaults of ``sgl-model-gateway/src/main.rs``: the
  defaults a launched router runs with (below). ``CacheAwareConfig::default()`` in
  ``sgl-model-gateway/src/policies/mod.rs`` has other values (0.5 / 32 / 1.1 / 30 s / 10,000) that only code
  building the config by hand gets; the launcher's are used here.

The algorithm (``CacheAwarePolicy::select_worker``), as implemented:

1. No usable candidate (upstream: no healthy worker): no replica.
2. Loads: ``load`` is the router's own count of its in-flight requests per worker (``Worker::load()``,
   incremented when the router sends a request and decremented when it ends) -> ``ReplicaLoad.outstanding``
   (queue_depth, kv_used, latency and token counts are not read: upstream does not read them either).
   min_load / max_load are folded over *all* candidates, excluded ones too (upstream folds over every worker
   of the model, healthy or not).
3. Imbalanced iff ``(max_load - min_load) > balance_abs_threshold`` AND ``max_load > min_load *
   balance_rel_threshold`` (the product in f32, as upstream: ``(max_load as f32) > (min_load as f32 *
   rel)``). Then: the least-loaded usable candidate, the first of equals in candidate order (Rust's
   ``min_by_key`` keeps the first minimum), and the prompt is still inserted into that worker's tree
   (``select_worker_min_load``). Reason ``balance``.
4. Balanced: prefix match of the prompt against the tree. The tree is shared by the model's workers
   (tenants): the match length is the longest prefix any tenant holds, and the tenant returned is one that
   holds the deepest matched node: the node's cached ``last_tenant``, which is the tenant that created the
   node (kept through splits), else any tenant of the node. Here: the deepest block any candidate holds, and
   of the candidates holding it the one that has held it longest (= the creator while it still holds it; a
   deterministic pick where upstream's is arbitrary). ``match_rate = matched / prompt length``.
   - ``match_rate > cache_threshold``: that worker, and the prompt is inserted into its tree. Reason
     ``affinity``. If that worker is not usable (upstream: not healthy), upstream falls back to the first
     healthy worker *without* inserting: here the first usable candidate, reason ``fallback``, no insert.
   - otherwise (a miss): the least-loaded usable candidate, first of equals (since PR #14650; before it,
     ``tree.get_smallest_tenant()``, the tenant with the fewest characters in the tree: ``miss_route =
     "smallest_tree"`` reproduces that, the smallest tree over all candidates, first of equals, falling back
     to the first usable one when it is excluded). The prompt is inserted into the chosen tree. Reason
     ``miss``.
   An empty prompt (no key, or no full block) has match rate 0: a miss.
5. Eviction (``evict_tenant_by_size``): per tenant, while its size exceeds ``max_tree_size``, remove its
   least recently used leaf (a node it holds that none of its children hold for it).

Mappings and deviations:

- Alphabet: upstream's tree stores raw request text (characters) and measures the match and the tree size in
  characters (``chars().count()``). Here the alphabet is the prompt's chained block hashes
  (``RoutingKey.block_hashes``, ``block_size`` tokens each): a worker's tree is the set of hashes routed
  there, prefix-closed (a chained hash names its whole prefix, so a per-worker set gives the same match
  lengths as a trie), and ``match_rate = matched_blocks * block_size / min(prompt_tokens, max_prompt_blocks
  * block_size)``. That approximates upstream's character ratio: characters and tokens are proportional on
  average, the match is rounded down to whole blocks (a prompt's partial last block never matches; a match
  that upstream counts mid-block is cut at the block start), and a prompt longer than the blocks hashed
  (``max_prompt_blocks``, as the prefix-affinity policy hashes) is judged on its hashed part.
- Tree size: upstream's ``max_tree_size`` (launcher default 2**26) counts characters per tenant; here blocks
  per replica, ``max_tree_size / (chars_per_token x block_size)`` with ``chars_per_token = 4`` (an assumption:
  the usual English BPE ratio; upstream has no such constant). ``max_tree_blocks`` overrides it.
- Eviction timing: upstream runs ``evict_tenant_by_size`` on a background thread every
  ``eviction_interval_secs`` (120 s), so a tree may exceed its bound between runs. A policy here has no clock
  or thread: a replica's tree is cut back to ``max_tree_blocks`` in `commit`, as soon as an insertion takes it
  over. LRU order is a commit order, not upstream's global epoch counter: every block of a routed prompt is
  refreshed by the commit (upstream refreshes only the inserted path's last node, and 1 in 8 prefix matches
  refresh the matched node); within one commit the deeper block counts as older, so the least recent entry is
  always a leaf, as upstream evicts only leaves.
- The tree is updated in `commit` (the request was sent), not during selection: `route` changes nothing, as
  the dispatcher requires; upstream's match-time LRU touch (1 in 8 matches) is dropped.
- Worker removal (``remove_tenant``) -> `forget`. Upstream also removes a matched tenant that is no longer a
  worker; here replicas that are not candidates (another model's, one gone) are simply not matched.
- Exclusion: upstream has health only. Excluded replicas (tried, draining, breaker open) are treated as
  unhealthy workers are: never chosen, but their loads count in the imbalance test and their trees in the
  match (step 4's fallback).
- Not reproduced: the newer per-DP-rank loads (``dp_aware``), the mesh sync of trees between router replicas,
  the event-driven tree (the smg fork's KV-event mode), the PD-disaggregated pair selection, and the
  random pick when no tree exists for the model (here a model's tree always exists, possibly empty).
- Cost: min/max loads are a scan of the candidates, as upstream's fold (linear in the pool); the match is a
  binary search over the prompt's blocks (O(log blocks) lookups), like the prefix-affinity index.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Container, Optional, Sequence

from exaserve_hpc.router.balancing import (
    Decision, ReplicaLoad, ReplicaPool, RoutingKey, RoutingPolicy, hashed_key,
)
from exaserve_hpc.router.prefix_index import FastBlockHasher

if TYPE_CHECKING:
    from exaserve_hpc.config.schema import BatchingConfig, RouterConfig

MIN_LOAD, SMALLEST_TREE = "min_load", "smallest_tree"
# sgl-model-gateway/bindings/python/sglang_router/router_args.py (RouterArgs) and src/main.rs (clap defaults):
CACHE_THRESHOLD = 0.3  # RouterArgs.cache_threshold / --cache-threshold
BALANCE_ABS_THRESHOLD = 64  # RouterArgs.balance_abs_threshold / --balance-abs-threshold
BALANCE_REL_THRESHOLD = 1.5  # RouterArgs.balance_rel_threshold / --balance-rel-threshold
EVICTION_INTERVAL_SECS = 120  # RouterArgs.eviction_interval_secs: not used (eviction at commit; module docstring)
MAX_TREE_SIZE_CHARS = 2 ** 26  # RouterArgs.max_tree_size / --max-tree-size (67108864), characters per tenant
# Not upstream: characters per token, to turn max_tree_size into blocks (English BPE averages about 4).
CHARS_PER_TOKEN = 4.0
# Not upstream: blocks hashed per prompt, as the prefix-affinity policy (affinity.AffinitySettings).
MAX_PROMPT_BLOCKS = 1024
_REASONS_THAT_INSERT = frozenset(("affinity", "balance", "miss"))  # upstream inserts on these, not on fallback


def _f32(x: float) -> float:
    """``x`` rounded to an IEEE single, as Rust's ``f32`` holds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class CacheAwareSettings:
    cache_threshold: float = CACHE_THRESHOLD
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD
    max_tree_size: int = MAX_TREE_SIZE_CHARS  # characters, as upstream's flag
    chars_per_token: float = CHARS_PER_TOKEN
    block_size: int = 16  # tokens per block: the site's router.block_size
    max_prompt_blocks: int = MAX_PROMPT_BLOCKS
    max_tree_blocks: Optional[int] = None  # blocks per replica; None: max_tree_size / (chars_per_token x block_size)
    miss_route: str = MIN_LOAD  # SMALLEST_TREE: the pre-#14650 miss rule (upstream's get_smallest_tenant)

    @classmethod
    def from_site(cls, router: "RouterConfig") -> "CacheAwareSettings":
        return cls(block_size=router.block_size)

    def tree_blocks(self) -> int:
        if self.max_tree_blocks is not None:
            return self.max_tree_blocks
        return max(1, int(self.max_tree_size // (self.chars_per_token * self.block_size)))

    def __post_init__(self) -> None:
        if self.miss_route not in (MIN_LOAD, SMALLEST_TREE):
            raise ValueError(f"miss_route {self.miss_route!r} is unknown; choose {MIN_LOAD} or {SMALLEST_TREE}")
        if self.max_tree_blocks is not None and self.max_tree_blocks < 1:
            raise ValueError(f"max_tree_blocks {self.max_tree_blocks!r} must be at least 1")


class SGLangCacheAware(RoutingPolicy):
    name = "sglang_cache_aware"
    uses_prefix = True

    @classmethod
    def from_site(cls, router: "RouterConfig", batching: "BatchingConfig") -> "SGLangCacheAware":
        return cls(CacheAwareSettings.from_site(router))

    @classmethod
    def prompt_hasher(cls, router: "RouterConfig") -> FastBlockHasher:
        return FastBlockHasher(router.block_size, MAX_PROMPT_BLOCKS)

    def __init__(self, settings: Optional[CacheAwareSettings] = None, **overrides):
        self.settings = settings or CacheAwareSettings(**overrides)
        s = self.settings
        self.hasher = FastBlockHasher(s.block_size, s.max_prompt_blocks)
        self.max_tree_blocks = s.tree_blocks()
        self._rel32 = _f32(s.balance_rel_threshold)
        # Per replica: its block hashes, least recently routed first (the LRU order eviction follows).
        self._trees: dict[str, OrderedDict[int, None]] = {}
        # Per block hash: the replicas holding it, in the order they came to hold it (the match's tie-break).
        self._holders: dict[int, dict[str, None]] = {}

    # ---------------------------------------------------------------- hooks

    def routing_key(self, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (),
                    scheme: str = "") -> RoutingKey:
        """The prompt's block hashes: ``hashes`` if the gateway computed them our way, else our own."""
        return hashed_key(self.hasher, prompt_token_ids, hashes, scheme)

    def forget(self, replica_id: str) -> None:
        """Upstream's ``remove_tenant``: the replica's tree goes."""
        tree = self._trees.pop(replica_id, None)
        if not tree:
            return
        holders = self._holders
        for h in tree:
            owners = holders.get(h)
            if owners is not None:
                owners.pop(replica_id, None)
                if not owners:
                    del holders[h]

    def tree_size(self, replica_id: str) -> int:
        """Blocks in the replica's tree."""
        tree = self._trees.get(replica_id)
        return len(tree) if tree else 0

    def held(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` in the replica's tree (prefix-closed: a binary search)."""
        tree = self._trees.get(replica_id)
        if not tree or not hashes:
            return 0
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if hashes[mid - 1] in tree:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _deepest(self, hashes: Sequence[int], allowed: Container[str]) -> int:
        """Leading blocks of ``hashes`` some replica of ``allowed`` holds (each tree is prefix-closed, so is
        their union: a binary search)."""
        holders = self._holders
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            owners = holders.get(hashes[mid - 1])
            if owners and any(r in allowed for r in owners):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---------------------------------------------------------------- choice

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        s = self.settings
        pool = candidates if isinstance(candidates, ReplicaPool) else None
        items = pool.members if pool is not None else candidates
        lo_load = hi_load = -1
        least: Optional[ReplicaLoad] = None  # the least-loaded usable candidate, first of equals
        for c in items:
            load = c.outstanding
            if lo_load < 0 or load < lo_load:
                lo_load = load
            if load > hi_load:
                hi_load = load
            if (least is None or load < least.outstanding) and c.replica_id not in exclude:
                least = c
        if least is None:
            return Decision(None, reason="none")
        hashes = key.block_hashes if key is not None else ()
        if hi_load - lo_load > s.balance_abs_threshold and hi_load > _f32(lo_load * self._rel32):
            return Decision(least.replica_id, self.held(least.replica_id, hashes), "balance")

        depth = 0
        if hashes:
            allowed = pool if pool is not None else {c.replica_id for c in items}
            depth = self._deepest(hashes, allowed)
        if depth:
            span = min(key.prompt_tokens, self.hasher.max_blocks * key.block_size)
            rate = depth * key.block_size / span if span > 0 else 0.0
            if rate > s.cache_threshold:
                winner = next(r for r in self._holders[hashes[depth - 1]] if r in allowed)
                if winner not in exclude:
                    return Decision(winner, depth, "affinity")
                return self._fallback(items, exclude, hashes)
        target = least
        if s.miss_route == SMALLEST_TREE:
            target = min(items, key=lambda c: self.tree_size(c.replica_id))  # first of equals
            if target.replica_id in exclude:
                return self._fallback(items, exclude, hashes)
        return Decision(target.replica_id, self.held(target.replica_id, hashes), "miss")

    def _fallback(self, items: Sequence[ReplicaLoad], exclude: Container[str], hashes: Sequence[int]) -> Decision:
        """Upstream's "fallback to first healthy worker" (its tree is not updated: see `commit`)."""
        first = next(c for c in items if c.replica_id not in exclude)
        return Decision(first.replica_id, self.held(first.replica_id, hashes), "fallback")

    def commit(self, decision: Decision, key: Optional[RoutingKey]) -> None:
        """Insert the prompt into the chosen replica's tree (upstream's ``tree.insert(text, url)``), then evict
        its least recently routed blocks while the tree is over ``max_tree_blocks``."""
        rid = decision.replica_id
        if rid is None or key is None or not key.block_hashes or decision.reason not in _REASONS_THAT_INSERT:
            return
        tree = self._trees.get(rid)
        if tree is None:
            tree = self._trees[rid] = OrderedDict()
        holders = self._holders
        for h in reversed(key.block_hashes):  # deepest first: within a commit the deeper block is the older
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
                owners = holders.get(h)
                if owners is None:
                    holders[h] = {rid: None}
                else:
                    owners[rid] = None
        excess = len(tree) - self.max_tree_blocks
        while excess > 0:  # the least recent entry is a leaf: its descendants were all touched before it
            h, _ = tree.popitem(last=False)
            owners = holders[h]
            del owners[rid]
            if not owners:
                del holders[h]
            excess -= 1
