"""`router/sglang_cache_aware.py`: SGLang's cache-aware policy (sgl-model-gateway/src/policies/cache_aware.rs):
its imbalance test and cache threshold switch exactly where upstream's do, its ties break as upstream's, its
trees are the router's own decisions, evicted LRU leaf-first, and it is built from a site config."""

from __future__ import annotations

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, RoutingKey
from exaserve_hpc.router.sglang_cache_aware import (
    BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD, SMALLEST_TREE, CacheAwareSettings,
    SGLangCacheAware,
)

BS = 16


def loads(*outstanding: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", "m", o, 256) for i, o in enumerate(outstanding)]


def prompt(tag: int, blocks: int, extra_tokens: int = 0) -> list[int]:
    return [tag * 100_000 + i for i in range(blocks * BS + extra_tokens)]


def key_of(policy: SGLangCacheAware, tokens: list[int]) -> RoutingKey:
    return policy.routing_key(tokens)


def seed(policy: SGLangCacheAware, replica: str, tokens: list[int], blocks: int) -> None:
    """Put the first ``blocks`` blocks of ``tokens`` into ``replica``'s tree, as a routed request would."""
    policy.choose([ReplicaLoad(replica, "m", 0, 256)], key=key_of(policy, tokens[:blocks * BS]))


def test_defaults_are_the_launched_routers():
    s = CacheAwareSettings()
    assert (CACHE_THRESHOLD, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD) == (0.3, 64, 1.5)
    assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold) == (0.3, 64, 1.5)
    assert s.tree_blocks() == 2 ** 26 // (4 * 16)  # upstream's 2**26 characters, 4 per token, 16 per block


def test_imbalance_needs_the_absolute_spread_strictly_above_its_threshold():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "r0", tokens, 10)
    key = key_of(p, tokens)
    d = p.route(loads(64, 0), key=key)  # spread 64, not > 64: balanced, the cached replica
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "affinity", 10)
    d = p.route(loads(65, 0), key=key)  # 65 > 64 and 65 > 0 x 1.5: imbalanced, the least loaded
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r1", "balance", 0)


def test_imbalance_needs_the_relative_spread_too():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "r0", tokens, 10)
    key = key_of(p, tokens)
    assert p.route(loads(201, 134), key=key).reason == "affinity"  # 201 > 134 x 1.5 = 201? no
    d = p.route(loads(202, 134), key=key)  # spread 68 > 64 and 202 > 201
    assert (d.replica_id, d.reason) == ("r1", "balance")


def test_the_relative_test_is_an_f32_product_as_upstream():
    # (117 as f32) > (90 as f32 * 1.3f32) holds in f32 (116.99999) but not in f64 (117.0)
    p = SGLangCacheAware(block_size=BS, balance_abs_threshold=0, balance_rel_threshold=1.3)
    tokens = prompt(1, 10)
    seed(p, "r0", tokens, 10)
    assert p.route(loads(117, 90), key=key_of(p, tokens)).reason == "balance"
    assert p.route(loads(116, 90), key=key_of(p, tokens)).reason == "affinity"


def test_excluded_replicas_loads_count_in_the_imbalance_test_but_they_are_never_chosen():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "r1", tokens, 10)
    d = p.route(loads(100, 3, 5), {"r0"}, key_of(p, tokens))  # r0's 100 makes it imbalanced
    assert (d.replica_id, d.reason) == ("r1", "balance")
    assert p.route(loads(100, 3, 5), {"r0", "r1"}, key_of(p, tokens)).replica_id == "r2"
    assert p.route(loads(1, 2), {"r0", "r1"}, key_of(p, tokens)).reason == "none"
    assert p.route([], key=key_of(p, tokens)).reason == "none"


def test_the_cache_threshold_is_strict_on_blocks_times_block_size_over_prompt_tokens():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)  # 160 tokens
    seed(p, "r0", tokens, 3)  # 48 / 160 = 0.3: not > 0.3
    d = p.route(loads(1, 0), key=key_of(p, tokens))
    assert (d.replica_id, d.reason) == ("r1", "miss")
    seed(p, "r0", tokens, 4)  # 64 / 160 = 0.4
    d = p.route(loads(1, 0), key=key_of(p, tokens))
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "affinity", 4)
    # the partial last block counts in the prompt's length: 64 / (160 + 60) < 0.3
    assert p.route(loads(1, 0), key=key_of(p, prompt(1, 10, extra_tokens=60))).reason == "miss"


def test_a_prompt_longer_than_the_hashed_blocks_is_judged_on_them():
    p = SGLangCacheAware(block_size=BS, max_prompt_blocks=4)
    long = prompt(1, 40)
    seed(p, "r0", long, 2)  # 2 of the 4 hashed blocks: 0.5, though 2 / 40 of the prompt
    assert p.route(loads(1, 0), key=key_of(p, long)).replica_id == "r0"


def test_a_miss_goes_to_the_least_loaded_not_the_smallest_tree():
    # since upstream PR #14650; the older rule (get_smallest_tenant) is miss_route="smallest_tree"
    new, old = SGLangCacheAware(block_size=BS), SGLangCacheAware(block_size=BS, miss_route=SMALLEST_TREE)
    for p in (new, old):
        seed(p, "r0", prompt(7, 8), 8)  # r0 has the bigger tree
        seed(p, "r2", prompt(8, 2), 2)
    key = key_of(new, prompt(9, 10))
    assert new.route(loads(0, 3, 1), key=key).replica_id == "r0"
    assert old.route(loads(0, 3, 1), key=key).replica_id == "r1"  # an empty tree
    assert old.route(loads(0, 3, 1), {"r1"}, key).reason == "fallback"  # upstream: its first healthy worker
    assert old.route(loads(0, 3, 1), {"r1"}, key).replica_id == "r0"
    with pytest.raises(ValueError, match="miss_route"):
        CacheAwareSettings(miss_route="random")


def test_ties_go_to_the_first_candidate_and_to_the_earliest_holder():
    p = SGLangCacheAware(block_size=BS)
    assert p.route(loads(2, 1, 1), key=key_of(p, prompt(1, 4))).replica_id == "r1"  # min_by_key: first minimum
    tokens = prompt(1, 10)
    seed(p, "r2", tokens, 10)
    seed(p, "r1", tokens, 10)
    assert p.route(loads(0, 0, 0), key=key_of(p, tokens)).replica_id == "r2"  # the node's creator
    seed(p, "r1", tokens + prompt(5, 1), 11)  # r1 alone holds one block more: the deepest match is its
    assert p.route(loads(0, 0, 0), key=key_of(p, tokens + prompt(5, 1))).replica_id == "r1"


def test_the_matched_replica_excluded_falls_back_to_the_first_usable_without_insertion():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "r1", tokens, 10)
    key = key_of(p, tokens)
    d = p.route(loads(0, 0, 0), {"r1"}, key)
    assert (d.replica_id, d.reason) == ("r0", "fallback")
    p.commit(d, key)
    assert p.tree_size("r0") == 0


def test_every_routed_prompt_is_inserted_even_when_imbalanced_and_route_changes_nothing():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    key = key_of(p, tokens)
    for _ in range(3):
        assert p.route(loads(80, 0), key=key).replica_id == "r1"
    assert p.tree_size("r1") == 0  # route alone records nothing
    assert p.choose(loads(80, 0), key=key) == "r1"  # imbalanced, still inserted (select_worker_min_load)
    assert p.tree_size("r1") == 10
    d = p.route(loads(5, 6), key=key)  # balanced now: the prompt's holder, though busier
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r1", "affinity", 10)


def test_only_candidates_are_matched():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "other-model", tokens, 10)
    d = p.route(loads(1, 0), key=key_of(p, tokens))
    assert (d.replica_id, d.reason) == ("r1", "miss")


def test_a_pool_and_a_list_decide_alike():
    a, b = SGLangCacheAware(block_size=BS), SGLangCacheAware(block_size=BS)
    pool = ReplicaPool()
    for c in loads(3, 0, 2, 1):
        pool.add(c)
    listed = loads(3, 0, 2, 1)
    for i in range(40):
        tokens = prompt(i % 5, 6 + i % 3)
        for c in listed:
            pool.get(c.replica_id).outstanding = c.outstanding = (c.outstanding + i) % 4
        assert a.choose(pool, key=key_of(a, tokens)) == b.choose(listed, key=key_of(b, tokens))


def test_eviction_removes_least_recently_routed_leaves_first():
    p = SGLangCacheAware(block_size=BS, max_tree_blocks=5)
    shared = prompt(1, 1)
    a = shared + prompt(2, 2)  # 3 blocks, the first shared
    b = shared + prompt(3, 2)
    seed(p, "r0", a, 3)
    seed(p, "r0", b, 3)  # 5 distinct blocks: at the bound
    assert p.tree_size("r0") == 5
    c = prompt(4, 2)
    seed(p, "r0", c, 2)  # 7 > 5: a's two own blocks go (the oldest leaves), the shared first block stays
    assert p.tree_size("r0") == 5
    assert p.held("r0", key_of(p, a).block_hashes) == 1
    assert p.held("r0", key_of(p, b).block_hashes) == 3
    assert p.held("r0", key_of(p, c).block_hashes) == 2
    seed(p, "r0", shared, 1)  # touching the shared block keeps it past b's leaves
    seed(p, "r0", prompt(5, 3), 3)
    assert p.held("r0", key_of(p, b).block_hashes) == 1  # b's two leaves and c's leaf went; c's first block stays
    assert p.held("r0", key_of(p, c).block_hashes) == 1
    assert p.held("r0", key_of(p, prompt(5, 3)).block_hashes) == 3


def test_forget_drops_the_replicas_tree():
    p = SGLangCacheAware(block_size=BS)
    tokens = prompt(1, 10)
    seed(p, "r0", tokens, 10)
    seed(p, "r1", tokens, 10)
    p.forget("r0")
    p.forget("gone")  # unknown: nothing
    assert p.tree_size("r0") == 0
    assert p.route(loads(0, 0), key=key_of(p, tokens)).replica_id == "r1"
    p.forget("r1")
    assert p._holders == {}
    assert p.route(loads(1, 0), key=key_of(p, tokens)).reason == "miss"


def test_no_key_or_a_prompt_under_one_block_is_a_miss():
    p = SGLangCacheAware(block_size=BS)
    assert p.choose(loads(2, 1)) == "r1"
    d = p.route(loads(2, 1), key=key_of(p, [1, 2, 3]))
    assert (d.replica_id, d.reason) == ("r1", "miss")


def test_routing_key_takes_the_gateways_hashes_when_hashed_our_way():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"block_size": 8}})
    p = SGLangCacheAware.from_site(site.router, site.batching)
    hasher = SGLangCacheAware.prompt_hasher(site.router)
    tokens = list(range(100))
    assert p.routing_key(tokens).block_hashes == hasher(tokens)
    assert len(hasher(tokens)) == 12
    theirs = [7] * 12
    assert list(p.routing_key(tokens, theirs, hasher.scheme).block_hashes) == theirs
    assert p.routing_key(tokens, theirs, "other-scheme").block_hashes == hasher(tokens)
    assert p.routing_key(tokens, theirs[:5], hasher.scheme).block_hashes == hasher(tokens)  # wrong count


def test_from_site():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}]})
    p = SGLangCacheAware.from_site(site.router, site.batching)
    assert isinstance(p, SGLangCacheAware) and p.name == "sglang_cache_aware" and p.uses_prefix
    assert not p.follows_kv_events
    assert p.settings.block_size == site.router.block_size
    assert p.max_tree_blocks == 2 ** 26 // (4 * site.router.block_size)
    tokens = prompt(1, 4)
    assert p.choose(loads(0, 0), key=p.routing_key(tokens)) == "r0"
    assert p.route(loads(1, 0), key=p.routing_key(tokens)).reason == "affinity"
