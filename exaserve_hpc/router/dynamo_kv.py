"""`dynamo_kv`: NVIDIA Dynamo's KV router (github.com/ai-dynamo/dynamo), its default worker selector.

Upstream sources read (Rust; the selector's formula is the same in all of them):
- lib/llm/src/kv_router/scheduler.rs @ db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4 and its successor
  lib/kv-router/src/scheduling/selector.rs (`DefaultWorkerSelector::select_worker`, `softmax_sample`);
- lib/kv-router/src/config.rs @ 870abbd1e540664f8738c867c2b702e1d1ce629b (`KvRouterConfig::default`);
- lib/kv-router/src/sequence.rs (`ActiveSequences`: add_request, potential_blocks_and_tokens,
  new_blocks, new_tokens, mark_prefill_completed, free, EXPIRY_DURATION);
- lib/kv-router/src/indexer (`RadixTree::find_matches`, `apply_event`) and lib/kv-router/src/approx.rs
  (`PruneConfig`, `PruneManager`: the `--no-kv-events` TTL and size pruning);
- docs/architecture/kv_cache_routing.md ("cost = overlap_score_weight * prefill_blocks + decode_blocks").
(The newest upstream trees have since reworked the selector into `overlap_score_credit` /
`prefill_load_scale` terms; this module is the `overlap_score_weight` formulation above, the one the
docs describe.)

The algorithm, per request, over every usable worker w (selector.rs):

    overlap_w          = leading prompt blocks the index says w caches (radix-tree depth, find_matches)
    prefill_tokens_w   = active_tokens_w + max(0, isl - overlap_w * block_size)   (sequence.rs new_tokens)
    prefill_blocks_w   = prefill_tokens_w / block_size                            (a float, not rounded)
    decode_blocks_w    = active_blocks_w + new_blocks_w(prompt blocks)            (sequence.rs)
    logit_w            = overlap_score_weight * prefill_blocks_w + decode_blocks_w   (lower is better)

- ``active_tokens_w``: upstream, the sum of `new_tokens` of the requests routed to w and not yet past
  prefill (removed by `mark_prefill_completed` at the first token). Here: `ReplicaLoad.prefill_tokens`,
  the dispatcher's count of exactly that (uncached prompt tokens sent, not yet at their first token, with
  this policy's `Decision.matched_blocks` credited). Same signal, no deviation.
- ``active_blocks_w`` / ``new_blocks_w``: upstream, the unique block hashes (deduplicated across
  requests: a shared system prompt counts once) of the prompts of the requests routed to w and not yet
  freed (freed at completion, or after 300 s as stale, `EXPIRY_DURATION`); ``new_blocks`` is how many of
  this prompt's blocks are not among them. Output blocks are not counted (`router_track_output_blocks`
  defaults to false). Here the policy keeps the same ledger (each committed request's block hashes, per
  replica, with reference counts) but is never told of completion, so it trusts the dispatcher's
  `ReplicaLoad.outstanding` (requests sent there and not finished): the newest ``outstanding`` entries
  of the replica's ledger are the active ones (completion assumed first-in first-out). The count of
  active requests is exact; which of them finished is the approximation. (Deviation: FIFO instead of
  upstream's per-request free.)
- Worker selection (`softmax_sample`): ``temperature == 0`` (the default): every worker of minimum
  logit (exact float equality); among several, the one with the smallest radix-tree size (blocks the
  index holds for it; 0 for a worker with no match, as upstream's `tree_sizes.get(w).unwrap_or(0)`);
  if those are all equal, uniformly at random. Upstream's `min_by_key` takes the first smallest tree in
  HashMap order when only some tie; here uniformly among the smallest (HashMap order is arbitrary).
  ``temperature > 0``: if all logits are equal, uniform; else p_w proportional to
  exp(-(logit_w / (max - min)) / temperature) (logits divided by their range, negated, scaled, then a
  stable softmax), sampled by one uniform draw against the cumulative sum.

Defaults (lib/kv-router/src/config.rs `KvRouterConfig::default`): overlap_score_weight 1.0,
router_temperature 0.0, use_kv_events true (-> ``mode="precise"``), router_ttl_secs 120,
router_max_tree_size 2^20, router_prune_target_ratio 0.8, router_track_active_blocks true,
router_track_output_blocks false, router_assume_kv_reuse true, router_replica_sync false.

Where the overlap comes from (``mode``; `from_site` takes the site's ``router.prefix_mode``):
- ``precise`` (upstream's default, ``use_kv_events``): the engines' KV events only (`on_kv_events`:
  BlockStored adds, BlockRemoved removes, AllBlocksCleared clears the replica), hashed as the engine
  hashes (`EngineBlockHasher`). Upstream `should_subscribe_to_kv_events` is use_kv_events and
  overlap_score_weight > 0, so `follows_kv_events` is too. The overlap is upstream's tree walk: from the
  first block, a worker counts until the first block it does not hold. Deviation: upstream drops a
  BlockStored whose parent block the worker's tree lacks (and recovers by querying the worker); we have no
  recovery path, so the blocks are stored anyway (the walk from the first block still only counts a
  leading run).
- ``approximate`` (upstream ``--no-kv-events``, `ApproxKvIndexer`): each committed decision records the
  prompt's blocks for the chosen worker (`process_routing_decision_for_request`). Upstream expires each
  (worker, block) 120 s after it was last recorded and, above router_max_tree_size entries, prunes the
  earliest-expiring ones (deepest first among equal expiry, `BlockEntry`'s order) down to 0.8 of it.
  Policies have no clock, so the TTL is counted in committed decisions (``ttl_requests``, default
  `DEFAULT_TTL_REQUESTS`: our substitute, not an upstream number); the size pruning is upstream's.

Mappings and other deviations:
- Prompts are known as `RoutingKey.block_hashes` (chained hashes of full blocks, at most the hasher's
  ``max_blocks``) and `prompt_tokens` (upstream ``isl``); upstream hashes tokens the same way (block
  hashes chained into sequence hashes), so nothing is lost to block granularity except that a prompt
  beyond ``max_blocks`` blocks has its tail uncounted in overlap and decode blocks.
- Upstream's optional router queue (`router_queue_threshold`: hold requests while every worker is
  over a prefill-token budget) is not reproduced: a policy cannot hold a request (Decision(None) would
  mean "no replica"); queue_depth, kv_used and latency_ewma_ms are not used, as upstream's formula does
  not use them.
- Data-parallel ranks (upstream scores each (worker, dp_rank)) map to replicas; router replica sync is
  moot (one policy instance per router; a second router's traffic is invisible to it, as upstream without
  `router_replica_sync`).
- `route` scores every usable candidate (upstream scans all workers): O(replicas) per decision, plus the
  tree walk over the prompt's blocks.

`route` changes nothing but random draws and a note of the chosen replica's `outstanding`, which only
`commit` reads (to trim that replica's ledger to its active requests before adding this one); a dropped
decision leaves no trace in what the next `route` computes.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from typing import Container, Optional, Sequence

from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from exaserve_hpc.router.affinity import APPROXIMATE, PRECISE, prompt_hasher
from exaserve_hpc.router.balancing import (
    Decision, ReplicaLoad, ReplicaPool, RoutingKey, RoutingPolicy, hashed_key,
)

log = logging.getLogger(__name__)

# lib/kv-router/src/config.rs, KvRouterConfig::default (commit 870abbd1e540664f8738c867c2b702e1d1ce629b)
DEFAULT_OVERLAP_SCORE_WEIGHT = 1.0  # overlap_score_weight
DEFAULT_ROUTER_TEMPERATURE = 0.0  # router_temperature
DEFAULT_MODE = PRECISE  # use_kv_events: true
DEFAULT_MAX_TREE_SIZE = 2 ** 20  # router_max_tree_size (also approx.rs PruneConfig::default)
DEFAULT_PRUNE_TARGET_RATIO = 0.8  # router_prune_target_ratio (also approx.rs PruneConfig::default)
UPSTREAM_TTL_SECS = 120.0  # router_ttl_secs: not used (no clock here), replaced by DEFAULT_TTL_REQUESTS
# Ours, not upstream's: the approximate index's TTL in committed decisions (120 s at ~83 requests/s).
DEFAULT_TTL_REQUESTS = 10_000
DEFAULT_BLOCK_SIZE = 16  # the site schema's router.block_size default; upstream takes the engine's


class _KvIndex:
    """Which replica holds which block: upstream's radix tree, keyed by chained block hash (a chained hash
    names its whole prefix, so hash -> holders is the tree's node -> workers)."""

    def __init__(self, max_tree_size: int, prune_target_ratio: float, ttl_requests: Optional[int]):
        self.holders: dict[int, set[str]] = {}
        self.blocks: dict[str, dict[int, None]] = {}  # per replica: its blocks (tree size = len)
        # Approximate mode: (replica, hash) -> tick of its last record, oldest first (a refresh moves it last).
        self.stamps: dict[tuple[str, int], int] = {}
        self.max_tree_size = max_tree_size
        self.prune_target_ratio = prune_target_ratio
        self.ttl_requests = ttl_requests
        self.tick = 0

    # ---------------------------------------------------------------- writes

    def store(self, replica_id: str, hashes: Sequence[int]) -> None:
        mine = self.blocks.setdefault(replica_id, {})
        holders = self.holders
        for h in hashes:
            s = holders.get(h)
            if s is None:
                holders[h] = {replica_id}
            else:
                s.add(replica_id)
            mine[h] = None

    def remove(self, replica_id: str, hashes: Sequence[int]) -> None:
        mine = self.blocks.get(replica_id)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                del mine[h]
                s = self.holders.get(h)
                if s is not None:
                    s.discard(replica_id)
                    if not s:
                        del self.holders[h]
            self.stamps.pop((replica_id, h), None)

    def clear(self, replica_id: str) -> None:
        mine = self.blocks.pop(replica_id, None)
        if not mine:
            return
        for h in mine:
            s = self.holders.get(h)
            if s is not None:
                s.discard(replica_id)
                if not s:
                    del self.holders[h]
        if self.stamps:
            for h in mine:
                self.stamps.pop((replica_id, h), None)

    def record(self, replica_id: str, hashes: Sequence[int]) -> None:
        """Approximate mode (upstream process_routing_decision_for_request + PruneManager): one decision."""
        self.tick += 1
        tick, stamps = self.tick, self.stamps
        self.store(replica_id, hashes)
        # Deepest first, so that among entries of equal age the deepest are pruned first (BlockEntry's order).
        for h in reversed(hashes):
            k = (replica_id, h)
            stamps.pop(k, None)
            stamps[k] = tick
        self._expire()

    def _expire(self) -> None:
        stamps = self.stamps
        doomed: list[tuple[str, int]] = []
        if self.ttl_requests is not None:
            horizon = self.tick - self.ttl_requests
            for k, t in stamps.items():  # oldest first
                if t > horizon:
                    break
                doomed.append(k)
        if len(stamps) - len(doomed) > self.max_tree_size:  # PruneManager::prune
            target = int(self.max_tree_size * self.prune_target_ratio)
            excess = len(stamps) - target
            doomed = []
            for k in stamps:
                if len(doomed) >= excess:
                    break
                doomed.append(k)
        for replica_id, h in doomed:
            self.remove(replica_id, (h,))

    # ---------------------------------------------------------------- reads

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        """RadixTree::find_matches: each holder's leading run of held blocks, from the first block."""
        if not hashes:
            return {}
        first = self.holders.get(hashes[0])
        if not first:
            return {}
        scores: dict[str, int] = {}
        active = set(first)
        depth = 1
        holders = self.holders
        for i in range(1, len(hashes)):
            nxt = holders.get(hashes[i])
            if not nxt:
                break
            if not active <= nxt:
                for r in active - nxt:
                    scores[r] = depth
                active &= nxt
                if not active:
                    break
            depth = i + 1
        for r in active:
            scores[r] = depth
        return scores

    def tree_size(self, replica_id: str) -> int:
        mine = self.blocks.get(replica_id)
        return len(mine) if mine else 0


class _ActiveSequences:
    """One replica's requests as upstream's ActiveSequences tracks them: each request's prompt blocks, and
    reference counts over them (its unique blocks are the active blocks)."""

    __slots__ = ("entries", "refs")

    def __init__(self) -> None:
        self.entries: deque[tuple[int, ...]] = deque()
        self.refs: dict[int, int] = {}

    def add(self, hashes: Sequence[int]) -> None:
        entry = tuple(hashes)
        self.entries.append(entry)
        refs = self.refs
        for h in entry:
            refs[h] = refs.get(h, 0) + 1

    def trim(self, keep: int) -> None:
        """Free the oldest requests until ``keep`` remain (FIFO completion)."""
        refs = self.refs
        while len(self.entries) > max(0, keep):
            for h in self.entries.popleft():
                n = refs[h] - 1
                if n:
                    refs[h] = n
                else:
                    del refs[h]

    def potential_blocks(self, active: int, hashes: Sequence[int]) -> int:
        """potential_blocks_and_tokens' blocks: unique blocks of the newest ``active`` requests, plus the
        blocks of ``hashes`` not among them. Reads only."""
        refs, n = self.refs, len(self.entries)
        if active <= 0 or n == 0:
            return len(hashes)
        if active >= n:
            unique, finished = len(refs), None
        else:
            finished = {}
            for i in range(n - active):  # the oldest: finished under FIFO
                for h in self.entries[i]:
                    finished[h] = finished.get(h, 0) + 1
            unique = len(refs) - sum(1 for h, c in finished.items() if refs[h] == c)
        # The active set is a union of hash chains, so the prompt's blocks in it are a leading run.
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            h = hashes[mid - 1]
            if refs.get(h, 0) > (finished.get(h, 0) if finished else 0):
                lo = mid
            else:
                hi = mid - 1
        return unique + len(hashes) - lo


def softmax_probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """selector.rs softmax_sample's distribution (temperature > 0; lower logit, likelier)."""
    lo, hi = min(logits), max(logits)
    if lo == hi:
        return [1.0 / len(logits)] * len(logits)
    span = hi - lo
    scaled = [-(v / span) / temperature for v in logits]
    top = max(scaled)
    probs = [math.exp(s - top) for s in scaled]
    total = sum(probs)
    return [p / total for p in probs]


class DynamoKvRouter(RoutingPolicy):
    name = "dynamo_kv"
    uses_prefix = True

    @classmethod
    def from_site(cls, router, batching) -> "DynamoKvRouter":
        """Upstream's defaults, with the site's block size, prefix mode and index bound (as max tree size)."""
        return cls(mode=router.prefix_mode, block_size=router.block_size, max_tree_size=router.index_blocks)

    @classmethod
    def prompt_hasher(cls, router):
        return prompt_hasher(router.prefix_mode, router.block_size)

    def __init__(self, overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
                 temperature: float = DEFAULT_ROUTER_TEMPERATURE, mode: str = DEFAULT_MODE,
                 block_size: int = DEFAULT_BLOCK_SIZE, seed: Optional[int] = None,
                 ttl_requests: Optional[int] = DEFAULT_TTL_REQUESTS, max_tree_size: int = DEFAULT_MAX_TREE_SIZE,
                 prune_target_ratio: float = DEFAULT_PRUNE_TARGET_RATIO, max_prompt_blocks: int = 1024):
        if mode not in (APPROXIMATE, PRECISE):
            raise ValueError(f"dynamo_kv mode {mode!r} is unknown; choose {APPROXIMATE} or {PRECISE}")
        if not overlap_score_weight >= 0 or not temperature >= 0:  # config.rs validates range(min = 0.0)
            raise ValueError("overlap_score_weight and temperature must be >= 0")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.overlap_score_weight = float(overlap_score_weight)
        self.temperature = float(temperature)
        self.mode = mode
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.hasher = prompt_hasher(mode, block_size, max_prompt_blocks)
        self.index = _KvIndex(max_tree_size, prune_target_ratio, ttl_requests)
        self.active: dict[str, _ActiveSequences] = {}
        self._chosen: Optional[tuple[str, int]] = None  # (replica, its outstanding) as the last route saw it
        self._block_size_checked = False

    # ---------------------------------------------------------------- hooks

    def routing_key(self, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (),
                    scheme: str = "") -> RoutingKey:
        return hashed_key(self.hasher, prompt_token_ids, hashes, scheme)

    @property
    def follows_kv_events(self) -> bool:
        # config.rs should_subscribe_to_kv_events: use_kv_events && overlap_score_weight > 0
        return self.mode == PRECISE and self.overlap_score_weight > 0

    def on_kv_events(self, replica_id: str, events: list) -> None:
        index = self.index
        for e in events:
            if isinstance(e, BlockStored):
                if not self._block_size_checked:
                    self._block_size_checked = True
                    if e.block_size != self.block_size:
                        log.warning("replica %s caches blocks of %d tokens but dynamo_kv's block_size is %d: "
                                    "no prefix will match; set router.block_size to %d", replica_id,
                                    e.block_size, self.block_size, e.block_size)
                index.store(replica_id, e.block_hashes)
            elif isinstance(e, BlockRemoved):
                index.remove(replica_id, e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                index.clear(replica_id)

    def forget(self, replica_id: str) -> None:
        """Upstream remove_worker (the index) and update_workers (its active sequences)."""
        self.index.clear(replica_id)
        self.active.pop(replica_id, None)

    # ---------------------------------------------------------------- choice

    def logits(self, candidates: Sequence[ReplicaLoad], key: Optional[RoutingKey],
               overlaps: Optional[dict[str, int]] = None) -> list[float]:
        """logit_w = overlap_score_weight * prefill_blocks_w + decode_blocks_w for each candidate."""
        if key is not None:
            bs, isl, hashes = key.block_size, key.prompt_tokens, key.block_hashes
        else:
            bs, isl, hashes = self.block_size, 0, ()
        if overlaps is None:
            overlaps = self.index.overlaps(hashes)
        w, active = self.overlap_score_weight, self.active
        out = []
        for c in candidates:
            rid = c.replica_id
            new_tokens = isl - overlaps.get(rid, 0) * bs
            prefill_blocks = (c.prefill_tokens + (new_tokens if new_tokens > 0 else 0)) / bs
            seqs = active.get(rid)
            decode_blocks = seqs.potential_blocks(c.outstanding, hashes) if seqs is not None else len(hashes)
            out.append(w * prefill_blocks + decode_blocks)
        return out

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        items = candidates.members if isinstance(candidates, ReplicaPool) else candidates
        usable = [c for c in items if c.replica_id not in exclude]
        if not usable:
            return Decision(None, reason="none")
        overlaps = self.index.overlaps(key.block_hashes) if key is not None and key.block_hashes else {}
        logits = self.logits(usable, key, overlaps)
        if self.temperature == 0.0:
            best = min(logits)
            tied = [c for c, v in zip(usable, logits) if v == best]
            if len(tied) > 1:  # upstream: smallest tree size, else uniformly at random
                sizes = [self.index.tree_size(c.replica_id) for c in tied]
                small = min(sizes)
                tied = [c for c, s in zip(tied, sizes) if s == small]
            chosen = tied[0] if len(tied) == 1 else tied[self.rng.randrange(len(tied))]
        else:
            probs = softmax_probabilities(logits, self.temperature)
            u, acc, chosen = self.rng.random(), 0.0, usable[-1]
            for c, p in zip(usable, probs):
                acc += p
                if u <= acc:
                    chosen = c
                    break
        rid = chosen.replica_id
        self._chosen = (rid, chosen.outstanding)
        depth = overlaps.get(rid, 0)
        reason = "affinity" if depth else ("spill" if overlaps else "balance")
        return Decision(rid, depth, reason)

    def commit(self, decision: Decision, key: Optional[RoutingKey]) -> None:
        """The request was sent: it joins the replica's active sequences (upstream add_request; the oldest
        beyond the replica's `outstanding` as `route` saw it are freed first) and, in approximate mode, the
        index (upstream process_routing_decision_for_request)."""
        rid = decision.replica_id
        if rid is None:
            return
        seqs = self.active.get(rid)
        if seqs is None:
            seqs = self.active[rid] = _ActiveSequences()
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen[0] == rid:
            seqs.trim(chosen[1])
        hashes = key.block_hashes if key is not None else ()
        seqs.add(hashes)
        if self.mode == APPROXIMATE and hashes:
            self.index.record(rid, hashes)
