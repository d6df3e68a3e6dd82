"""Prefix affinity: longest cached match wins unless overloaded among the candidates; hot prefixes spread."""

from __future__ import annotations

from collections import Counter

import pytest

from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, WeightSettings

BLOCK = 16


def pool_of(n: int, batch: int = 32) -> ReplicaPool:
    pool = ReplicaPool()
    for i in range(n):
        pool.add(ReplicaLoad(f"r{i}", "m", 0, batch))
    return pool


def policy(**kw) -> PrefixAffinity:
    kw.setdefault("weights", WeightSettings(explore=0.0))
    return PrefixAffinity(AffinitySettings(block_size=BLOCK, **kw), seed=5)


def route(p: PrefixAffinity, pool, exclude=frozenset(), key=None):
    decision = p.route(pool, exclude, key)
    p.commit(decision, key)  # as the dispatcher does once the request is sent
    return decision


def prompt(conversation: int, blocks: int) -> list[int]:
    return [conversation * 100_000 + i for i in range(blocks * BLOCK)]


def test_same_prefix_goes_back_to_the_replica_that_holds_it():
    p, pool = policy(), pool_of(8)
    first = route(p, pool, key=p.routing_key(prompt(1, 20)))
    assert first.reason == "balance" and first.matched_blocks == 0
    follow = route(p, pool, key=p.routing_key(prompt(1, 20) + list(range(40))))  # next turn: longer
    assert follow.replica_id == first.replica_id
    assert follow.reason == "affinity" and follow.matched_blocks == 20


def test_longest_match_wins_over_a_shorter_one():
    p, pool = policy(), pool_of(8)
    p.index.record("r3", p.routing_key(prompt(1, 4)).block_hashes)
    p.index.record("r5", p.routing_key(prompt(1, 12)).block_hashes)
    d = route(p, pool, key=p.routing_key(prompt(1, 12)))
    assert (d.replica_id, d.matched_blocks) == ("r5", 12)


def test_overloaded_holder_is_passed_over_for_the_next_best_then_a_fresh_one():
    p, pool = policy(), pool_of(8, batch=8)
    p.index.record("r1", p.routing_key(prompt(1, 12)).block_hashes)
    p.index.record("r2", p.routing_key(prompt(1, 8)).block_hashes)
    pool.get("r1").outstanding = 12  # beyond its batch: requests wait for a slot there
    d = route(p, pool, key=p.routing_key(prompt(1, 12)))
    assert (d.replica_id, d.matched_blocks, d.reason) == ("r2", 8, "affinity")
    pool.get("r2").outstanding = 12
    d = route(p, pool, key=p.routing_key(prompt(1, 12)))
    assert d.reason == "spill" and d.replica_id not in ("r1", "r2")
    # The fresh replica now holds the prefix too: the hot prefix has spread.
    assert d.replica_id in dict(p.index.match(p.routing_key(prompt(1, 12)).block_hashes))


def test_imbalance_is_judged_against_candidates_not_an_idle_fleet_elsewhere():
    # The holder carries a little more than the alternatives: a cached 64-block prompt is worth it.
    p, pool = policy(), pool_of(16)
    key = p.routing_key(prompt(1, 64))
    p.index.record("r0", key.block_hashes)
    pool.get("r0").outstanding = 3
    for c in pool:
        if c.replica_id != "r0":
            c.outstanding = 2
    assert route(p, pool, key=key).replica_id == "r0"


def test_hot_prefix_spreads_under_load_but_stays_on_few_replicas():
    p, pool = policy(), pool_of(16, batch=8)
    hot = prompt(7, 32)
    chosen = Counter()
    for i in range(64):  # 64 concurrent requests sharing a long prefix, each with its own tail
        d = route(p, pool, key=p.routing_key(hot + [i] * BLOCK))
        pool.get(d.replica_id).outstanding += 1
        chosen[d.replica_id] += 1
    assert 2 <= len(chosen) <= 12  # spread beyond one replica, not sprayed over the fleet
    assert max(c.outstanding for c in pool) <= 10  # no replica far beyond its batch


def test_unrelated_prompts_are_balanced():
    p, pool = policy(), pool_of(8)
    for i in range(80):
        d = route(p, pool, key=p.routing_key(prompt(i, 4)))
        pool.get(d.replica_id).outstanding += 1
    spread = [c.outstanding for c in pool]
    assert max(spread) - min(spread) <= 4


def test_excluded_and_forgotten_replicas_are_not_chosen():
    p, pool = policy(), pool_of(4)
    key = p.routing_key(prompt(1, 8))
    p.index.record("r2", key.block_hashes)
    assert route(p, pool, exclude={"r2"}, key=key).replica_id != "r2"
    other = p.routing_key(prompt(2, 8))
    p.index.record("r2", other.block_hashes)
    p.forget("r2")  # it left: its cache no longer counts
    assert route(p, pool, key=other).reason == "balance"


def test_precise_mode_follows_kv_events_with_engine_hashes():
    from exaserve_hpc.engine.block_manager import prompt_block_hashes
    from exaserve_hpc.engine.kv_events import BlockStored

    p, pool = policy(mode="precise"), pool_of(4)
    tokens = prompt(3, 6)
    hashes = prompt_block_hashes(tokens, BLOCK)
    p.on_kv_events("r3", [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                      block_size=BLOCK)])
    d = route(p, pool, key=p.routing_key(tokens))
    assert (d.replica_id, d.matched_blocks) == ("r3", 6)


def test_the_router_uses_a_gateways_hashes_only_when_they_are_its_own():
    p = policy()
    tokens = prompt(1, 8) + [7, 7, 7]  # 8 full blocks and a partial one
    mine = p.routing_key(tokens).block_hashes
    given = [h + 1 for h in mine]  # distinguishable from what the router would compute
    assert p.routing_key(tokens, given, p.hasher.scheme).block_hashes == given
    assert p.routing_key(tokens, given, "some-other-hasher").block_hashes == mine
    assert p.routing_key(tokens, given[:-1], p.hasher.scheme).block_hashes == mine  # wrong count
    assert p.routing_key(tokens, given + [1], p.hasher.scheme).block_hashes == mine
    precise = policy(mode="precise")
    assert precise.hasher.scheme != p.hasher.scheme
    assert PrefixAffinity(AffinitySettings(block_size=32)).hasher.scheme != p.hasher.scheme


def test_a_gateway_process_hashes_exactly_like_the_router():
    """The approximate hasher relies on Python's tuple hash having no per-process salt."""
    import subprocess
    import sys
    tokens = prompt(3, 5)
    code = ("import sys; from exaserve_hpc.router.affinity import AffinitySettings; "
            f"h = AffinitySettings(block_size={BLOCK}).hasher(); print(h.scheme); print(h({tokens!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random", "PATH": "/usr/bin:/bin"}).stdout.split("\n")
    p = policy()
    assert out[0] == p.hasher.scheme and out[1] == str(p.routing_key(tokens).block_hashes)


def test_the_dispatcher_routes_and_records_by_the_gateways_hashes():
    from exaserve_hpc.protocol import GenerateRequest, ReplicaHello
    from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
    p = policy()
    d = Dispatcher(p, DispatchSettings(), {"m"})
    for i in range(4):
        d.on_replica_message(f"r{i}", ReplicaHello(replica_id=f"r{i}", model="m", pid=i, max_batch_size=8,
                                                   max_seq_len=4096), 0.0)
    tokens = prompt(2, 4)
    given = [h ^ 0x5A5A for h in p.routing_key(tokens).block_hashes]
    [out] = d.on_request(b"gw", GenerateRequest(request_id="q", model="m", prompt_token_ids=tokens, max_tokens=1,
                                                 prefix_hashes=given, prefix_scheme=p.hasher.scheme), 0.0)
    assert p.index.holders(given[-1]) == [out.peer.decode()]
    assert p.index.holders(p.routing_key(tokens).block_hashes[-1]) == []


def test_all_the_prefill_work_queued_at_a_replica_is_ahead_of_a_new_prompt():
    # Prompts are admitted in arrival order as KV room frees (TensorRT-LLM reserves a request's KV whole),
    # so a short prompt behind one 60,000-token prefill waits for all of it: more than behind four
    # 3,000-token ones (no cap at "each prompt in prefill delays it by at most its own work").
    p = policy()
    one_long = ReplicaLoad("r0", "m", 1, 32, prefill_tokens=60_000)
    several = ReplicaLoad("r1", "m", 4, 32, prefill_tokens=12_000)
    assert p.cost(one_long, 500, 0.0) > p.cost(several, 500, 0.0)
    s = p.settings
    assert p.cost(several, 500, 0.0) == (12_000 + 500 + s.base_tokens) * (1 + 4 * s.decode_share)
    pool = ReplicaPool()
    pool.add(one_long)
    pool.add(several)
    assert route(p, pool, key=p.routing_key(prompt(1, 30))).replica_id == "r1"


def test_the_replicas_step_time_does_not_scale_the_cost_by_default():
    # A replica busy with a long prefill reports a long step time; its queued tokens already count that work.
    p = PrefixAffinity(AffinitySettings(block_size=BLOCK), seed=5)  # the defaults a site gets
    fast = ReplicaLoad("r0", "m", 1, 32, prefill_tokens=1000, latency_ewma_ms=10.0)
    slow = ReplicaLoad("r1", "m", 1, 32, prefill_tokens=1000, latency_ewma_ms=400.0)
    assert p.cost(fast, 500, 205.0) == p.cost(slow, 500, 205.0)
    scaled = policy(weights=WeightSettings(samples=4, latency_cap=10.0))  # the factor is still there to opt in
    assert scaled.cost(slow, 500, 205.0) > scaled.cost(fast, 500, 205.0)


def test_a_drawn_replica_that_holds_part_of_the_prefix_is_credited_with_it():
    p, pool = policy(matches=1), pool_of(2, batch=8)  # both replicas are drawn; one match is looked up
    key = p.routing_key(prompt(1, 12))
    p.index.record("r1", p.routing_key(prompt(1, 8)).block_hashes)
    p.index.record("r0", key.block_hashes)  # the newest holder: the one `match` returns
    pool.get("r0").outstanding = 12  # beyond its batch
    d = route(p, pool, key=key)
    assert (d.replica_id, d.matched_blocks, d.reason) == ("r1", 8, "affinity")
    assert dict(p.index.match(key.block_hashes, limit=2)) == {"r0": 12, "r1": 12}  # now holds all of it
    assert p._held("r9", key.block_hashes, 12) == 0  # never seen by the index
    p.forget("r1")  # its cache is gone: no credit
    pool.get("r1").outstanding = 1
    d = route(p, pool, key=key)
    assert (d.replica_id, d.matched_blocks, d.reason) == ("r1", 0, "spill")


def test_cost_constants_come_from_the_timing_model():
    """No tuned numbers: one step's overhead, a decode's share of a prefill step and attention's
    pair cost, each in prefill-token units of the GPU's timing model."""
    from exaserve_hpc.engine.timing import GPU_TIMINGS

    t = GPU_TIMINGS["h200"]
    s = AffinitySettings.from_timings(t, 8192, 12000.0, block_size=512)
    assert s.base_tokens == pytest.approx(t.step_overhead_s / t.prefill_per_token_s)
    step = t.step_overhead_s + 8192 * t.prefill_per_token_s
    assert s.decode_share == pytest.approx((t.decode_per_seq_s + 12000 * t.kv_read_per_token_s) / step)
    assert s.pair_tokens == pytest.approx(t.prefill_per_pair_s / t.prefill_per_token_s)
    assert s.block_size == 512
    policy = PrefixAffinity(s, seed=0)
    idle = ReplicaLoad("r", "m", 0, 64)
    # attention: 32k uncached tokens cost more than 4x 8k, and cached tokens before them add to it
    assert policy.cost(idle, 32768, 0.0, 32768) > 4.2 * policy.cost(idle, 8192, 0.0, 8192)
    assert policy.cost(idle, 1024, 0.0, 30000) > policy.cost(idle, 1024, 0.0, 1024)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_small_pool_is_compared_whole_so_the_least_loaded_replica_is_never_missed(compiled):
    """With nothing cached, each decision takes the cheapest of all 16 replicas (a pool of at most
    compare_all_up_to); a draw of 4 would miss the one idle replica three times in four."""
    import random
    rng = random.Random(7)
    pool = pool_of(16)
    p = PrefixAffinity(AffinitySettings(block_size=BLOCK, weights=WeightSettings(explore=0.0)), seed=5,
                       compiled=compiled)
    drawn_only = PrefixAffinity(AffinitySettings(block_size=BLOCK, weights=WeightSettings(explore=0.0),
                                                 compare_all_up_to=8), seed=5, compiled=compiled)
    missed = 0
    for i in range(200):
        for c in pool:
            c.outstanding = rng.randrange(2, 9)
        idle = pool[rng.randrange(16)]
        idle.outstanding = 0
        assert p.route(pool, key=p.routing_key(prompt(i, 3))).replica_id == idle.replica_id
        missed += drawn_only.route(pool, key=drawn_only.routing_key(prompt(i, 3))).replica_id != idle.replica_id
    assert missed > 100  # what comparing 4 drawn replicas costs here
