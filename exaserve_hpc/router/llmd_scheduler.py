"""`router.policy: llmd_scheduler`: llm-d's inference scheduler (its endpoint picker, EPP) with its shipped profile.

Upstream: github.com/llm-d/llm-d-inference-scheduler at commit 520af47896e5f06e43d09aca281a1149187b0ffd
(Go module github.com/llm-d/llm-d-router; the EPP scheduling framework of kubernetes-sigs/gateway-api-inference-extension
(GIE) now lives there: GIE's own tree at 84436a96 has none of it, and GIE's last copy, at a03894d9 under
pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go, has the same prefix rules as below). Paths are
relative to the llm-d-inference-scheduler repository unless named otherwise.

The profile llm-d ships (three places agree):
- pkg/epp/config/loader/defaults.go `loadDefaultConfig` (the EPP with no config file): queue-scorer weight 2,
  kv-cache-utilization-scorer weight 2, prefix-cache-scorer weight 3; `ensureSchedulingLayer` adds the
  single-profile-handler and a max-score-picker when the profile names no picker;
- config/charts/epplib/templates/_config.yaml, `default-plugins.yaml` (the Helm chart's config map): the same three
  scorers with weights 2, 2, 3 and no picker (so max-score-picker is injected);
- github.com/llm-d/llm-d guides/inference-scheduling/scheduler/inference-scheduling.values.yaml (the "inference
  scheduling" well-lit path, commit 086f217d): the same three scorers, weights 2, 2, 3.
No filter runs in that profile. The utilization saturation detector `ensureSaturationDetector` adds
(pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/detector.go; queue 5, KV 0.8) is a Filter
only when a profile lists it; by default it serves admission alone (pkg/epp/requestcontrol/admission.go: it
rejects *sheddable* requests, priority < 0, while the pool is saturated). Our router has no priorities or
admission layer, so nothing of it is implemented. (deploy/config/epp-config.yaml, a sample, adds decode-filter,
scheduling/filter/bylabel/roles.go: it keeps pods labelled decode-capable and unlabelled ones; our replicas have
no roles, so it would keep them all.)

Prefix scoring is the approximate one. prefix-cache-scorer
(pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go) reads PrefixCacheMatchInfo, which the
approx-prefix-cache-producer (registered as that key's default producer in cmd/epp/runner/runner.go) writes:
pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/{plugin,hashing,indexer,types}.go.
Precise (KV-event) scoring is another plugin, precise-prefix-cache-scorer, used only by the sample
deploy/config/epp-precise-prefix-cache-config.yaml, not by the default profile; it is not implemented here
(``router.prefix_mode`` is ignored: this policy never follows KV events).

The algorithm, per request (pkg/epp/scheduling/scheduler_profile.go `Run`: filters, scorers, picker):
1. Prompt blocks (hashing.go `hashPrompt`): chained hashes of fixed-size blocks, at most
   ``max_prefix_blocks`` (types.go defaultMaxPrefixBlocks = 256) of them, plus one hash for a trailing partial
   block when the prompt is not truncated; a prompt shorter than one block has none.
2. Match (plugin.go `matchLongestPrefix`): walk the prompt's blocks in order; stop at the first block no
   replica holds; every replica holding a walked block gets +1. (A replica's count is the number of walked
   blocks it holds, which need not be a contiguous run from the first block: kept as upstream counts.)
3. Scores, each clamped to [0, 1] (scheduler_profile.go `enforceScoreRange`) and summed with the weights
   (`runScorerPlugins`: sum of weight x score, not divided by the weights' sum):
   - prefix-cache-scorer: matched blocks / the prompt's blocks (0 when it has none);
   - queue-scorer (scorer/queuedepth/queue.go): (max queue - own queue) / (max queue - min queue) over the
     candidates, 1.0 for all when every queue is equal;
   - kv-cache-utilization-scorer (scorer/kvcacheutilization/kvcache_utilization.go): 1 - KV-cache usage.
4. max-score-picker (picker/maxscore/picker.go, picker/common.go): shuffle, stable-sort by score, take the
   first: the highest weighted sum, ties (exactly equal sums) broken uniformly at random.
5. After the choice (plugin.go `PreRequest`, which the request's send follows; done asynchronously there):
   the chosen replica's per-replica LRU (indexer.go, hashicorp golang-lru: `Add` refreshes a present block) gets
   the prompt's block hashes in order; an evicted block stops naming that replica. A replica no longer in the
   pool is dropped whole (`CleanUpInactivePods`, every 2 minutes, types.go podActiveCheckInterval).

Mappings onto ReplicaLoad:
- queue-scorer's waiting-queue size is vLLM's ``vllm:num_requests_waiting``, scraped from each pod's /metrics
  every 50 ms (pkg/epp/server/options.go RefreshMetricsInterval, TotalQueuedRequestsMetric): here
  `ReplicaLoad.queue_depth`, the requests the replica reports waiting at its engine (periodic ReplicaStats).
- kv-cache-utilization-scorer's KVCacheUsagePercent (``vllm:kv_cache_usage_perc``, a fraction 0..1): here
  `ReplicaLoad.kv_used`.
- The router-side counts (outstanding, prefill_tokens, decode_tokens, prefilling) and latency_ewma_ms are not
  read: the default profile has no scorer that uses in-flight counts or latency.
- The candidates are the usable replicas: ``exclude`` plays the part of upstream's filters (queue min/max are
  taken over the replicas left, as upstream's scorers see only the endpoints its filters left).

Deviations:
- Granularity: upstream hashes the request *text* (chat messages as JSON, or the completion prompt) in blocks
  of block-size-tokens x 4 characters (types.go averageCharactersPerToken = 4), xxhash64 seeded with the model
  name and cache salt. Our policies see only token-block hashes (RoutingKey.block_hashes, blocks of
  ``router.block_size`` tokens), so blocks here are token blocks: upstream's block size auto-tunes to the
  engine's KV block size (plugin.go `GetBlockSize`, the pods' ``cache_config_info``; default 16 tokens,
  types.go defaultBlockSizeTokens), which is what ``router.block_size`` is. The model seed is not needed: a
  router's candidates are one model's replicas.
- The trailing partial block: it counts in the prompt's total (upstream's denominator, step 1) but, having no
  hash here, never matches; upstream matches it only on an exactly repeated prompt (score 1.0 there, at most
  full/(full+1) here).
- The LRU capacity: upstream's per-server default is 31,250 blocks (types.go defaultLRUCapacityPerServer:
  "500K tokens ... / 16 = 31.25K blocks") of 16 tokens, auto-tuned to the pod's ``num_gpu_blocks`` when
  its metrics report one. The policy sees no replica's block count, so it keeps the default's 500,000 tokens:
  31,250 x 16 // ``block_size`` of our blocks per replica (``lru_capacity_per_server`` overrides it).
  ``router.index_blocks`` (our own index's total bound) is not used.
- Time: the inactive-pod sweep (2 minutes) is `forget` here, called when a replica leaves or restarts cold;
  the indexer update is synchronous in `commit` (upstream: a goroutine after PreRequest, so a request that
  follows at once may not see it yet).
- Upstream's insertion adds every hash to the LRU and then every hash to the hash -> pods map, which leaves
  stale entries when a single prompt has more blocks than the capacity; here each block is inserted and
  indexed together (the same result whenever capacity >= blocks per prompt, as with the defaults: 256 <= 31,250).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Container, Optional, Sequence

from exaserve_hpc.router.balancing import (
    Decision, ReplicaLoad, ReplicaPool, RoutingKey, RoutingPolicy, hashed_key,
)
from exaserve_hpc.router.prefix_index import FastBlockHasher

if TYPE_CHECKING:
    from exaserve_hpc.config.schema import BatchingConfig, RouterConfig

# The shipped profile's weights: pkg/epp/config/loader/defaults.go loadDefaultConfig (queueScorerWeight,
# kvCacheUtilizationScorerWeight, prefixCacheScorerWeight), the same in config/charts/epplib/templates/_config.yaml
# and llm-d/llm-d guides/inference-scheduling/scheduler/inference-scheduling.values.yaml.
QUEUE_WEIGHT = 2.0
KV_CACHE_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0
# approximateprefix/types.go defaultMaxPrefixBlocks: blocks hashed and matched per prompt.
MAX_PREFIX_BLOCKS = 256
# approximateprefix/types.go defaultBlockSizeTokens (vLLM's default KV block size) and defaultLRUCapacityPerServer:
# the per-server LRU holds 31,250 of those blocks (500,000 tokens); converted to our block size in `__init__`.
UPSTREAM_BLOCK_SIZE_TOKENS = 16
UPSTREAM_LRU_CAPACITY_PER_SERVER = 31_250


def prompt_blocks(prompt_tokens: int, block_size: int, max_blocks: int) -> int:
    """How many hashes upstream's `hashPrompt` makes for a prompt of this length: none below one block,
    else the full blocks plus a trailing partial one, at most ``max_blocks`` (truncation drops the partial)."""
    if prompt_tokens < block_size:
        return 0
    blocks = -(-prompt_tokens // block_size)
    return blocks if blocks < max_blocks else max_blocks


class ApproxPrefixIndexer:
    """approximateprefix/indexer.go: a per-replica LRU of block hashes and the hash -> replicas map it keeps."""

    def __init__(self, capacity_per_server: int):
        if capacity_per_server < 1:
            raise ValueError(f"capacity_per_server must be >= 1, got {capacity_per_server}")
        self.capacity = capacity_per_server
        self.hash_to_replicas: dict[int, dict[str, None]] = {}  # insertion-ordered sets
        self.replica_lru: dict[str, OrderedDict[int, None]] = {}

    def add(self, replica_id: str, hashes: Sequence[int]) -> None:
        """`indexer.Add`: each hash becomes the replica's most recent; the least recent go past capacity."""
        lru = self.replica_lru.get(replica_id)
        if lru is None:
            lru = self.replica_lru[replica_id] = OrderedDict()
        index, cap = self.hash_to_replicas, self.capacity
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > cap:
                    self._evicted(replica_id, lru.popitem(last=False)[0])
            holders = index.get(h)
            if holders is None:
                index[h] = {replica_id: None}
            else:
                holders[replica_id] = None

    def _evicted(self, replica_id: str, h: int) -> None:
        """`makeEvictionFn`: the replica no longer holds the block."""
        holders = self.hash_to_replicas.get(h)
        if holders is not None:
            holders.pop(replica_id, None)
            if not holders:
                del self.hash_to_replicas[h]

    def get(self, h: int) -> Optional[dict[str, None]]:
        return self.hash_to_replicas.get(h)

    def remove(self, replica_id: str) -> None:
        """`indexer.RemovePod`: every block of the replica's LRU is dropped."""
        lru = self.replica_lru.pop(replica_id, None)
        if lru is not None:
            for h in lru:
                self._evicted(replica_id, h)

    def match_longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """`matchLongestPrefix`: walk until a block nobody holds; +1 to each holder of each walked block."""
        found: dict[str, int] = {}
        index = self.hash_to_replicas
        for h in hashes:
            holders = index.get(h)
            if not holders:
                break
            for r in holders:
                found[r] = found.get(r, 0) + 1
        return found


class LlmdScheduler(RoutingPolicy):
    """llm-d's default EPP profile: weighted queue, KV-cache-utilisation and approximate prefix-cache scores,
    max-score pick with random ties. See the module docstring for the upstream sources and the mappings."""

    name = "llmd_scheduler"
    uses_prefix = True

    def __init__(self, queue_weight: float = QUEUE_WEIGHT, kv_cache_weight: float = KV_CACHE_WEIGHT,
                 prefix_weight: float = PREFIX_WEIGHT, seed: Optional[int] = None, *, block_size: int = 16,
                 max_prefix_blocks: int = MAX_PREFIX_BLOCKS, lru_capacity_per_server: Optional[int] = None):
        """``lru_capacity_per_server``: blocks of ``block_size`` tokens each replica's LRU holds; None: upstream's
        default of 31,250 blocks of 16 tokens, as many tokens in our blocks (at least 1 block)."""
        self.queue_weight = float(queue_weight)
        self.kv_cache_weight = float(kv_cache_weight)
        self.prefix_weight = float(prefix_weight)
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        if lru_capacity_per_server is None:
            lru_capacity_per_server = max(1, UPSTREAM_LRU_CAPACITY_PER_SERVER * UPSTREAM_BLOCK_SIZE_TOKENS // block_size)
        self.indexer = ApproxPrefixIndexer(lru_capacity_per_server)
        self.hasher = FastBlockHasher(block_size, max_prefix_blocks)
        self.rng = random.Random(seed)  # the picker's tie-break (upstream: picker.PickerRand)

    @classmethod
    def from_site(cls, router: "RouterConfig", batching: "BatchingConfig") -> "LlmdScheduler":
        return cls(block_size=router.block_size)

    @classmethod
    def prompt_hasher(cls, router: "RouterConfig") -> FastBlockHasher:
        return FastBlockHasher(router.block_size, MAX_PREFIX_BLOCKS)

    def routing_key(self, prompt_token_ids: Sequence[int], hashes: Sequence[int] = (),
                    scheme: str = "") -> RoutingKey:
        """The prompt's block hashes: ``hashes`` if the gateway computed them our way, else our own."""
        return hashed_key(self.hasher, prompt_token_ids, hashes, scheme)

    def forget(self, replica_id: str) -> None:
        self.indexer.remove(replica_id)

    def scores(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
               key: Optional[RoutingKey] = None) -> tuple[list[tuple[float, ReplicaLoad, int]], bool]:
        """(weighted score, candidate, matched blocks) of each usable candidate, and whether any held a prefix."""
        items = candidates.members if isinstance(candidates, ReplicaPool) else candidates
        usable = [c for c in items if c.replica_id not in exclude]
        if not usable:
            return [], False
        matched: dict[str, int] = {}
        total = 0
        if key is not None:
            hashes = key.block_hashes
            if len(hashes) > self.max_prefix_blocks:
                hashes = hashes[:self.max_prefix_blocks]
            total = prompt_blocks(key.prompt_tokens, key.block_size, self.max_prefix_blocks)
            if hashes and total:
                matched = self.indexer.match_longest_prefix(hashes)
        lo = hi = usable[0].queue_depth
        for c in usable:
            q = c.queue_depth
            if q < lo:
                lo = q
            elif q > hi:
                hi = q
        span = hi - lo
        wq, wkv, wp = self.queue_weight, self.kv_cache_weight, self.prefix_weight
        out = []
        held = False
        for c in usable:
            # In the profile's order (queue, kv, prefix), each clamped to [0, 1] as enforceScoreRange does.
            queue = 1.0 if span == 0 else (hi - c.queue_depth) / span
            kv = 1.0 - c.kv_used
            kv = 0.0 if kv < 0.0 else (1.0 if kv > 1.0 else kv)
            depth = matched.get(c.replica_id, 0)
            if depth:
                held = True
            prefix = depth / total if total else 0.0
            prefix = prefix if prefix < 1.0 else 1.0
            out.append((0.0 + queue * wq + kv * wkv + prefix * wp, c, depth))
        return out, held

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        scored, held = self.scores(candidates, exclude, key)
        if not scored:
            return Decision(None, reason="none")
        best = max(s for s, _, _ in scored)
        top = [(c, depth) for s, c, depth in scored if s == best]
        c, depth = top[0] if len(top) == 1 else top[self.rng.randrange(len(top))]
        return Decision(c.replica_id, depth, "affinity" if depth else ("spill" if held else "balance"))

    def commit(self, decision: Decision, key: Optional[RoutingKey]) -> None:
        """`PreRequest`: the chosen replica now (probably) holds the prompt's blocks."""
        if decision.replica_id is not None and key is not None and key.block_hashes:
            hashes = key.block_hashes
            if len(hashes) > self.max_prefix_blocks:
                hashes = hashes[:self.max_prefix_blocks]
            self.indexer.add(decision.replica_id, hashes)
