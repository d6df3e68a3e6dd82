"""llm-d's inference scheduler, default profile (router/llmd_scheduler.py): queue-scorer x2, kv-cache-utilization-scorer
x2, approximate prefix-cache-scorer x3, max-score-picker with random ties; the per-replica LRU prefix indexer."""

from __future__ import annotations

from collections import Counter

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.router.balancing import Decision, ReplicaLoad, ReplicaPool, RoutingKey
from exaserve_hpc.router.llmd_scheduler import ApproxPrefixIndexer, LlmdScheduler, prompt_blocks
from exaserve_hpc.router.prefix_index import FastBlockHasher

BS = 16


def load(rid: str, queue: int = 0, kv: float = 0.0, outstanding: int = 0) -> ReplicaLoad:
    return ReplicaLoad(rid, "m", outstanding, 8, queue_depth=queue, kv_used=kv)


def key_for(tokens: list[int], policy: LlmdScheduler) -> RoutingKey:
    return policy.routing_key(tokens)


def scores_by_id(policy, candidates, exclude=frozenset(), key=None) -> dict[str, float]:
    scored, _ = policy.scores(candidates, exclude, key)
    return {c.replica_id: s for s, c, _ in scored}


def test_defaults_are_llmds_shipped_profile_and_the_lru_keeps_500k_tokens():
    p = LlmdScheduler()
    assert (p.queue_weight, p.kv_cache_weight, p.prefix_weight) == (2.0, 2.0, 3.0)
    assert p.max_prefix_blocks == 256 and p.name == "llmd_scheduler" and p.uses_prefix
    assert not p.follows_kv_events
    assert p.indexer.capacity == 31_250  # 16-token blocks: upstream's default as is
    assert LlmdScheduler(block_size=8).indexer.capacity == 62_500
    assert LlmdScheduler(block_size=64).indexer.capacity == 7_812
    assert LlmdScheduler(lru_capacity_per_server=10).indexer.capacity == 10


def test_from_site_takes_the_block_size():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}]})
    p = LlmdScheduler.from_site(site.router, site.batching)
    assert isinstance(p, LlmdScheduler)
    assert p.block_size == site.router.block_size == 16 and p.indexer.capacity == 31_250
    assert LlmdScheduler.prompt_hasher(site.router).scheme == p.hasher.scheme
    site = parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"block_size": 32}})
    assert LlmdScheduler.from_site(site.router, site.batching).indexer.capacity == 15_625


def test_queue_and_kv_scores_combine_with_the_weights():
    p = LlmdScheduler(seed=0)
    loads = [load("a", queue=0, kv=0.5), load("b", queue=10, kv=0.0), load("c", queue=5, kv=0.1)]
    got = scores_by_id(p, loads)
    # queue: (max - q) / (max - min); kv: 1 - used; 2 x each
    assert got["a"] == pytest.approx(2 * 1.0 + 2 * 0.5)
    assert got["b"] == pytest.approx(2 * 0.0 + 2 * 1.0)
    assert got["c"] == pytest.approx(2 * 0.5 + 2 * 0.9)
    assert p.route(loads).replica_id == "a"
    # Other weights: kv alone decides.
    assert LlmdScheduler(queue_weight=0.0, seed=0).route(loads).replica_id == "b"


def test_equal_queues_are_neutral_and_out_of_range_usage_is_clamped():
    p = LlmdScheduler(seed=0)
    got = scores_by_id(p, [load("a", queue=3, kv=1.5), load("b", queue=3, kv=-0.5)])
    assert got == {"a": 2.0, "b": 2.0 + 2.0}  # queue 1.0 each; kv clamped to 0 and 1
    # Router-side counts are not read: only the engine's waiting queue.
    got = scores_by_id(p, [load("a", outstanding=100), load("b", outstanding=0)])
    assert got["a"] == got["b"] == 4.0


def test_a_cached_prefix_outweighs_load_exactly_where_the_weights_say():
    p = LlmdScheduler(seed=1)
    prompt = list(range(8 * BS))  # 8 full blocks
    key = key_for(prompt, p)
    p.commit(Decision("b"), key)
    fresh = load("a", queue=0, kv=0.0)  # 2 + 2 = 4
    d = p.route([fresh, load("b", queue=4, kv=0.0)], key=key)  # 0 + 2 + 3 = 5
    assert (d.replica_id, d.matched_blocks, d.reason) == ("b", 8, "affinity")
    d = p.route([fresh, load("b", queue=4, kv=0.51)], key=key)  # 0 + 0.98 + 3 < 4
    assert (d.replica_id, d.matched_blocks, d.reason) == ("a", 0, "spill")
    # At kv 0.5 the sums tie (4 = 4): the picker breaks it at random.
    picks = Counter(p.route([fresh, load("b", queue=4, kv=0.5)], key=key).replica_id for _ in range(400))
    assert set(picks) == {"a", "b"} and all(150 <= n <= 250 for n in picks.values()), picks


def test_prefix_score_is_matched_over_total_blocks_with_the_partial_block_in_the_total():
    p = LlmdScheduler(queue_weight=0, kv_cache_weight=0)
    shared = list(range(8 * BS))
    p.commit(Decision("b"), key_for(shared, p))
    longer = shared + [999] * (BS // 2)  # 8 full blocks + a partial one: 9 upstream hashes
    assert prompt_blocks(len(longer), BS, 256) == 9
    got = scores_by_id(p, [load("a"), load("b")], key=key_for(longer, p))
    assert got == {"a": 0.0, "b": pytest.approx(3 * 8 / 9)}
    assert scores_by_id(p, [load("b")], key=key_for(shared, p)) == {"b": 3.0}
    # A prompt shorter than one block has no blocks: no prefix score even when its tokens were seen.
    assert prompt_blocks(BS - 1, BS, 256) == 0
    assert scores_by_id(p, [load("b")], key=key_for(shared[:BS - 1], p)) == {"b": 0.0}


def test_at_most_256_blocks_are_hashed_recorded_and_counted():
    p = LlmdScheduler(queue_weight=0, kv_cache_weight=0)
    prompt = list(range(300 * BS + 5))
    key = key_for(prompt, p)
    assert len(key.block_hashes) == 256 and prompt_blocks(len(prompt), BS, 256) == 256
    p.commit(Decision("a"), key)
    assert len(p.indexer.replica_lru["a"]) == 256
    # Differs only past block 256: upstream truncates too, so it is the same prefix, fully matched.
    other = prompt[:256 * BS] + [7] * (50 * BS)
    d = p.route([load("a"), load("b")], key=key_for(other, p))
    assert (d.replica_id, d.matched_blocks) == ("a", 256)
    assert scores_by_id(p, [load("a")], key=key_for(other, p)) == {"a": 3.0}


def test_matching_walks_until_a_block_nobody_holds_and_counts_every_holder():
    idx = ApproxPrefixIndexer(100)
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2])
    idx.add("c", [9, 3, 4])  # holds blocks 3 and 4 of the walk, not block 1
    assert idx.match_longest_prefix([1, 2, 3, 4, 5]) == {"a": 4, "b": 2, "c": 2}
    assert idx.match_longest_prefix([1, 7, 3, 4]) == {"a": 1, "b": 1}  # stops at 7
    assert idx.match_longest_prefix([8, 1]) == {}


def test_the_lru_evicts_each_replicas_least_recent_blocks():
    idx = ApproxPrefixIndexer(4)
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2, 3, 4])
    idx.add("a", [1])  # refreshed: 2 is now a's least recent
    idx.add("a", [5, 6])  # evicts 2 then 3 from a only
    assert list(idx.replica_lru["a"]) == [4, 1, 5, 6]
    assert idx.match_longest_prefix([1, 2, 3, 4]) == {"a": 2, "b": 4}
    idx.add("b", [7, 8, 9, 10])  # b's old blocks all go; 2 and 3 then name nobody
    assert 2 not in idx.hash_to_replicas and 3 not in idx.hash_to_replicas
    assert idx.match_longest_prefix([1, 2]) == {"a": 1}


def test_a_full_lru_forgets_the_prompt_start_first_and_the_match_stops_there():
    p = LlmdScheduler(queue_weight=0, kv_cache_weight=0, lru_capacity_per_server=6)
    first = list(range(4 * BS))
    p.commit(Decision("a"), key_for(first, p))
    p.commit(Decision("a"), key_for([10_000 + t for t in range(3 * BS)], p))  # evicts first's block 0 only
    d = p.route([load("a"), load("b")], key=key_for(first, p))
    assert d.matched_blocks == 0 and d.reason == "balance"


def test_forget_drops_only_that_replicas_entries():
    p = LlmdScheduler(seed=3)
    key = key_for(list(range(4 * BS)), p)
    p.commit(Decision("a"), key)
    p.commit(Decision("b"), key)
    p.forget("a")
    assert "a" not in p.indexer.replica_lru
    assert p.indexer.match_longest_prefix(key.block_hashes) == {"b": 4}
    p.forget("b")
    assert p.indexer.hash_to_replicas == {}
    p.forget("never-seen")


def test_excluded_replicas_are_never_chosen_and_route_changes_nothing():
    p = LlmdScheduler(seed=5)
    key = key_for(list(range(4 * BS)), p)
    p.commit(Decision("best"), key)
    pool = ReplicaPool()
    for c in (load("best"), load("x", queue=9, kv=0.9), load("y", queue=9, kv=0.9)):
        pool.add(c)
    before = {r: list(lru) for r, lru in p.indexer.replica_lru.items()}
    picks = {p.route(pool, {"best"}, key).replica_id for _ in range(100)}
    assert picks == {"x", "y"}
    assert {r: list(lru) for r, lru in p.indexer.replica_lru.items()} == before  # route recorded nothing
    assert p.route(pool, {"best", "x", "y"}, key) == Decision(None, reason="none")
    assert p.route([], key=key).reason == "none"
    assert p.route(pool, key=key).replica_id == "best"


def test_exclusion_acts_like_a_filter_for_the_queue_range():
    p = LlmdScheduler()
    loads = [load("a", queue=0), load("b", queue=4), load("c", queue=8)]
    assert scores_by_id(p, loads, {"a"}) == {"b": 2 * 1.0 + 2.0, "c": 2 * 0.0 + 2.0}


def test_commit_without_a_replica_or_key_records_nothing_and_choose_commits():
    p = LlmdScheduler(seed=0)
    key = key_for(list(range(2 * BS)), p)
    p.commit(Decision(None, reason="none"), key)
    p.commit(Decision("a"), None)
    assert p.indexer.replica_lru == {}
    assert p.choose([load("a")], key=key) == "a"
    assert p.indexer.match_longest_prefix(key.block_hashes) == {"a": 2}


def test_routing_key_takes_the_gateways_hashes_only_under_its_scheme():
    p = LlmdScheduler()
    tokens = list(range(3 * BS + 4))
    own = FastBlockHasher(BS, 256)(tokens)
    assert p.routing_key(tokens).block_hashes == own
    gateway = [11, 12, 13]
    assert p.routing_key(tokens, gateway, p.hasher.scheme).block_hashes == gateway
    assert p.routing_key(tokens, gateway, "other-scheme").block_hashes == own
    assert p.routing_key(tokens, [11, 12], p.hasher.scheme).block_hashes == own  # wrong length: rehashed
    k = p.routing_key(tokens)
    assert (k.prompt_tokens, k.block_size) == (len(tokens), BS)


def test_ties_are_uniform_and_a_seed_repeats_them():
    loads = [load(f"r{i}") for i in range(4)]
    p = LlmdScheduler(seed=2)
    picks = Counter(p.route(loads).replica_id for _ in range(4000))
    assert set(picks) == {"r0", "r1", "r2", "r3"} and all(850 <= n <= 1150 for n in picks.values()), picks
    a, b = LlmdScheduler(seed=7), LlmdScheduler(seed=7)
    assert [a.route(loads).replica_id for _ in range(50)] == [b.route(loads).replica_id for _ in range(50)]
