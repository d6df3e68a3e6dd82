"""`dynamo_kv` (router/dynamo_kv.py): Dynamo's KV router selector, logit = overlap_score_weight x
prefill_blocks + decode_blocks, argmin at temperature 0 (tree-size then random tie-break), softmax over
range-normalised logits above it; overlap from KV events (precise) or from its own decisions (approximate)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from exaserve_hpc.router.balancing import Decision, ReplicaLoad, ReplicaPool, RoutingKey
from exaserve_hpc.router.dynamo_kv import (
    DEFAULT_MAX_TREE_SIZE, DEFAULT_OVERLAP_SCORE_WEIGHT, DEFAULT_PRUNE_TARGET_RATIO, DEFAULT_ROUTER_TEMPERATURE,
    DynamoKvRouter,
)

BS = 16


def key(hashes, tokens=None):
    return RoutingKey(list(hashes), len(hashes) * BS if tokens is None else tokens, BS)


def loads(*specs):
    """(id, prefill_tokens, outstanding) -> ReplicaLoad"""
    return [ReplicaLoad(r, "m", out, 64, prefill_tokens=p) for r, p, out in specs]


def stored(hashes, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=BS)


PROMPT = list(range(100, 108))  # 8 blocks, 128 tokens


def test_upstream_defaults():
    p = DynamoKvRouter()
    assert (DEFAULT_OVERLAP_SCORE_WEIGHT, DEFAULT_ROUTER_TEMPERATURE) == (1.0, 0.0)
    assert (DEFAULT_MAX_TREE_SIZE, DEFAULT_PRUNE_TARGET_RATIO) == (2 ** 20, 0.8)
    assert (p.overlap_score_weight, p.temperature, p.mode) == (1.0, 0.0, "precise")
    assert p.follows_kv_events
    assert not DynamoKvRouter(mode="approximate").follows_kv_events
    assert not DynamoKvRouter(overlap_score_weight=0).follows_kv_events  # should_subscribe_to_kv_events
    with pytest.raises(ValueError):
        DynamoKvRouter(mode="fuzzy")
    with pytest.raises(ValueError):
        DynamoKvRouter(temperature=-1)


def test_logit_is_weight_times_prefill_blocks_plus_decode_blocks():
    p = DynamoKvRouter(overlap_score_weight=2.0, block_size=BS)
    p.on_kv_events("a", [stored(PROMPT[:3])])
    p.commit(Decision("b"), key([7, 8, PROMPT[0] + 1000]))  # b runs an unrelated 3-block request
    cands = loads(("a", 40, 0), ("b", 10, 1), ("c", 0, 0))
    got = p.logits(cands, key(PROMPT, tokens=130))  # 130 tokens: 8 full blocks + 2
    # a: prefill (40 + 130 - 3*16) / 16, decode 8 new blocks;  b: (10 + 130) / 16, 3 active + 8 new
    assert got == [2.0 * (40 + 130 - 48) / 16 + 8, 2.0 * 140 / 16 + 11, 2.0 * 130 / 16 + 8]


def test_active_blocks_deduplicate_a_shared_prefix_and_follow_outstanding_fifo():
    p = DynamoKvRouter(block_size=BS)
    shared = [1, 2, 3, 4]
    p.commit(Decision("a"), key(shared + [10, 11]))
    p.commit(Decision("a"), key(shared + [20]))
    req = key(shared + [30, 31])
    # both active: unique {1,2,3,4,10,11,20} = 7, plus the request's 2 blocks not among them
    assert p.logits(loads(("a", 0, 2)), req) == [req.prompt_tokens / BS + 9]
    # one finished (FIFO: the oldest): active {1,2,3,4,20} = 5, +2
    assert p.logits(loads(("a", 0, 1)), req) == [req.prompt_tokens / BS + 7]
    # the finished request's own blocks no longer count as active for a prompt that shares them
    again = key(shared + [10, 11, 12])
    assert p.logits(loads(("a", 0, 1)), again) == [again.prompt_tokens / BS + 5 + 3]
    # none active: the request's own 6 blocks
    assert p.logits(loads(("a", 0, 0)), req) == [req.prompt_tokens / BS + 6]
    # the trim happens at commit, to what route saw: a then holds 1 + this request
    pool = loads(("a", 0, 1))
    assert p.route(pool, key=req).replica_id == "a"
    p.commit(Decision("a"), req)
    assert list(p.active["a"].entries) == [tuple(shared + [20]), tuple(shared + [30, 31])]


@pytest.mark.parametrize("weight, threshold", [(1.0, 224), (2.0, 144)])
def test_cost_switches_where_the_formula_says(weight, threshold):
    """a caches 4 of the 8 blocks but has prefill backlog P; b caches nothing and runs a 10-block request.
    logit_a = w (P + 64) / 16 + 8, logit_b = w 128 / 16 + 18: a wins iff P < 64 + 160 / w; at equality
    the tie goes to the smaller radix tree (b holds none)."""
    def pick(backlog, seed=0):
        p = DynamoKvRouter(overlap_score_weight=weight, block_size=BS, seed=seed)
        p.on_kv_events("a", [stored(PROMPT[:4])])
        p.commit(Decision("b"), key(range(500, 510)))
        return p.route(loads(("a", backlog, 0), ("b", 0, 1)), key=key(PROMPT))
    below, at, above = pick(threshold - 1), pick(threshold), pick(threshold + 1)
    assert (below.replica_id, below.matched_blocks, below.reason) == ("a", 4, "affinity")
    assert (at.replica_id, at.reason) == ("b", "spill")
    assert {pick(threshold, seed).replica_id for seed in range(20)} == {"b"}  # not a coin flip
    assert above.replica_id == "b"


def test_temperature_zero_is_argmin_with_tree_size_then_random_tie_break():
    p = DynamoKvRouter(seed=3)
    cands = loads(("a", 32, 0), ("b", 16, 0), ("c", 48, 0))
    assert {p.choose(cands, key=key(PROMPT)) for _ in range(50)} == {"b"}
    # equal logits, equal (empty) trees: uniform among the tied
    tied = loads(("a", 0, 0), ("b", 0, 0), ("c", 0, 0), ("d", 64, 0))
    picks = Counter(p.route(tied, key=key(PROMPT)).replica_id for _ in range(3000))
    assert set(picks) == {"a", "b", "c"} and all(850 <= n <= 1150 for n in picks.values()), picks
    # equal logits, unequal trees (a prefix elsewhere): the smallest tree wins
    p.on_kv_events("a", [stored([900, 901])])
    p.on_kv_events("b", [stored([950])])
    assert {p.route(tied, key=key(PROMPT)).replica_id for _ in range(50)} == {"c"}


def test_temperature_samples_in_proportion_to_upstreams_softmax():
    t = 0.5
    p = DynamoKvRouter(temperature=t, seed=11)
    cands = loads(("a", 0, 0), ("b", 32, 0), ("c", 96, 0))
    logits = [8 + 8.0, 8 + 10.0, 8 + 14.0]  # 128/16 prompt blocks + backlog, + 8 decode blocks
    assert p.logits(cands, key(PROMPT)) == logits
    span = max(logits) - min(logits)
    weights = [math.exp(-(v / span) / t) for v in logits]
    expected = [w / sum(weights) for w in weights]  # about 0.72, 0.26, 0.03
    n = 20000
    picks = Counter(p.route(cands, key=key(PROMPT)).replica_id for _ in range(n))
    for rid, q in zip("abc", expected):
        sigma = math.sqrt(n * q * (1 - q))
        assert abs(picks[rid] - n * q) < 5 * sigma, (picks, expected)
    # all logits equal: uniform
    flat = loads(("a", 0, 0), ("b", 0, 0))
    picks = Counter(p.route(flat, key=key(PROMPT)).replica_id for _ in range(4000))
    assert all(1850 <= v <= 2150 for v in picks.values()), picks


def test_kv_events_add_and_remove_overlap():
    p = DynamoKvRouter(block_size=BS)
    cands = loads(("a", 0, 0), ("b", 0, 0))
    p.on_kv_events("a", [stored(PROMPT[:2]), stored(PROMPT[2:6], parent=PROMPT[1])])
    p.on_kv_events("b", [stored(PROMPT[:3])])
    d = p.route(cands, key=key(PROMPT))
    assert (d.replica_id, d.matched_blocks) == ("a", 6)
    p.on_kv_events("a", [BlockRemoved(block_hashes=[PROMPT[1]])])  # a hole: the walk stops before it
    d = p.route(cands, key=key(PROMPT))
    assert (d.replica_id, d.matched_blocks) == ("b", 3)
    p.on_kv_events("b", [AllBlocksCleared()])
    d = p.route(cands, key=key(PROMPT))
    assert (d.replica_id, d.matched_blocks, d.reason) == ("a", 1, "affinity")
    p.forget("a")
    assert p.route(cands, key=key(PROMPT)).matched_blocks == 0
    # precise mode records nothing from its own decisions
    p.commit(Decision("a", 0), key(PROMPT))
    assert p.index.overlaps(PROMPT) == {}


def test_approximate_mode_records_decisions_and_expires_them_by_count():
    p = DynamoKvRouter(mode="approximate", block_size=BS, ttl_requests=3)
    cands = loads(("a", 0, 0), ("b", 0, 0))
    p.commit(Decision("b"), key(PROMPT[:5]))
    d = p.route(cands, key=key(PROMPT))
    assert (d.replica_id, d.matched_blocks) == ("b", 5)
    p.commit(Decision("a"), key([1]))
    p.commit(Decision("a"), key([2]))
    assert p.index.overlaps(PROMPT) == {"b": 5}
    p.commit(Decision("a"), key([3]))  # three decisions later: b's entries are gone
    assert p.index.overlaps(PROMPT) == {}
    assert p.index.tree_size("b") == 0


def test_approximate_pruning_keeps_the_newest_and_drops_deepest_first():
    p = DynamoKvRouter(mode="approximate", block_size=BS, ttl_requests=None, max_tree_size=10,
                       prune_target_ratio=0.8)
    p.commit(Decision("a"), key(range(0, 6)))
    p.commit(Decision("b"), key(range(10, 15)))  # 11 entries > 10: prune to 8, oldest (a's) deepest first
    assert p.index.overlaps(list(range(0, 6))) == {"a": 3}
    assert p.index.overlaps(list(range(10, 15))) == {"b": 5}


def test_excluded_replicas_are_never_chosen_and_none_when_nothing_is_usable():
    p = DynamoKvRouter(temperature=1.0, seed=5)
    pool = ReplicaPool()
    for c in loads(("a", 0, 0), ("b", 500, 0), ("c", 900, 0)):
        pool.add(c)
    p.on_kv_events("a", [stored(PROMPT)])
    assert {p.choose(pool, {"a"}, key(PROMPT)) for _ in range(300)} == {"b", "c"}
    assert p.route(pool, {"a", "b", "c"}, key(PROMPT)) == Decision(None, reason="none")


def test_route_changes_nothing_the_next_route_sees():
    p = DynamoKvRouter(mode="approximate", seed=1)
    p.commit(Decision("a"), key(PROMPT[:4]))
    cands = loads(("a", 0, 1), ("b", 0, 0))
    first = [p.route(cands, key=key(PROMPT)) for _ in range(5)]
    assert all(d == first[0] for d in first)
    assert p.index.overlaps(PROMPT) == {"a": 4} and len(p.active["a"].entries) == 1


def test_from_site_and_routing_key():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}]})
    p = DynamoKvRouter.from_site(site.router, site.batching)
    assert (p.mode, p.block_size, p.index.max_tree_size) == (
        site.router.prefix_mode, site.router.block_size, site.router.index_blocks)
    assert not p.follows_kv_events  # the site default is approximate
    precise = parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"prefix_mode": "precise"}})
    q = DynamoKvRouter.from_site(precise.router, precise.batching)
    assert q.follows_kv_events
    tokens = list(range(40))
    hasher = DynamoKvRouter.prompt_hasher(precise.router)
    k = q.routing_key(tokens, hasher(tokens), hasher.scheme)
    assert list(k.block_hashes) == list(hasher(tokens)) and k.prompt_tokens == 40 and len(k.block_hashes) == 2
    assert list(q.routing_key(tokens, [1, 2], "other").block_hashes) == list(hasher(tokens))
