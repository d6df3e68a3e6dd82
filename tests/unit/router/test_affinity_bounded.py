"""Prefix affinity with bounded loads (router.max_load_factor): a hot prefix cannot pile requests onto its
holders beyond max(1, factor x the pool's mean of requests before their first token), and the dispatcher
keeps that count, and each pool's sum of it, in step with what it sends."""

from __future__ import annotations

import math
import random

import pytest

from exaserve_hpc.config.schema import ConfigError, parse_site
from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, TokenChunk
from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, WeightSettings, shift_prefilling
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.policies import make_policy, policy_for_site

from tests.router.test_affinity import BLOCK, pool_of  # the same block size and pool of idle replicas


def policy(factor: float, samples: int = 4, explore: float = 0.0, compiled: bool = True) -> PrefixAffinity:
    weights = WeightSettings(samples=samples, explore=explore)
    return PrefixAffinity(AffinitySettings(block_size=BLOCK, max_load_factor=factor, weights=weights), seed=5,
                          compiled=compiled)


def prompt(conversation: int, blocks: int, tail: int = 0) -> list[int]:
    return [conversation * 100_000 + i for i in range(blocks * BLOCK)] + [7] * tail


def bound_after(pool: ReplicaPool, factor: float) -> float:
    """The bound as the issue states it, computed by a scan (the policy reads the pool's running sum)."""
    return max(1.0, factor * (sum(c.prefilling for c in pool) + 1) / len(pool))


def send(pool: ReplicaPool, p: PrefixAffinity, key) -> tuple:
    """Route one request and count it on its replica until its first token, as the dispatcher does (only
    that count moves: the costs stay as they are, so the holder stays the cheapest); also the bound at 2."""
    bound = bound_after(pool, 2.0)
    decision = p.route(pool, frozenset(), key)
    p.commit(decision, key)
    load = pool.get(decision.replica_id)
    shift_prefilling(load, [pool], 1)
    return decision, load, bound


@pytest.mark.parametrize("compiled", [True, False])
def test_a_hot_prefix_stays_within_the_bound_and_piles_up_without_it(compiled):
    # One long shared system prompt, short distinct tails: its holder is by far the cheapest by cost, so
    # without the cap it collects the whole burst; with it, no decision puts a replica past the bound
    # (every replica is a candidate here, so one within the bound always exists for factor 2), and the
    # replicas it spills to become holders in turn.
    over = {}
    for factor in (0.0, 2.0):
        rng = random.Random(1)
        p, pool = policy(factor, samples=8, compiled=compiled), pool_of(8)
        reasons, over[factor] = set(), 0
        for i in range(300):
            decision, load, bound = send(pool, p, p.routing_key(prompt(1, 64, tail=rng.randrange(1, 15))))
            reasons.add(decision.reason)
            over[factor] += load.prefilling > bound
            if rng.random() < 0.5:  # some requests reach their first token meanwhile
                shift_prefilling(rng.choice([c for c in pool if c.prefilling]), [pool], -1)
            assert pool.prefilling_sum == sum(c.prefilling for c in pool)
        assert ("bounded" in reasons) == bool(factor)
    assert over[0.0] > 250, over  # the pile-up the cap exists for
    assert over[2.0] == 0
    assert len({r for r, _ in p.index.match(p.routing_key(prompt(1, 64)).block_hashes, limit=8)}) > 1


def test_past_the_bound_the_cheapest_within_it_wins_a_shorter_holder_first():
    for compiled in (True, False):
        p, pool = policy(2.0, samples=4, compiled=compiled), pool_of(4)
        key = p.routing_key(prompt(1, 12))
        p.index.record("r0", key.block_hashes)
        p.index.record("r1", p.routing_key(prompt(1, 4)).block_hashes)
        shift_prefilling(pool.get("r0"), [pool], 3)  # 3 + 1 > 2 x (3 + 1) / 4
        d = p.route(pool, frozenset(), key)
        assert (d.replica_id, d.matched_blocks, d.reason) == ("r1", 4, "bounded")
        shift_prefilling(pool.get("r1"), [pool], 3)  # the bound is now 2 x 7 / 4 = 3.5: neither holder fits
        pool.get("r3").outstanding = 2  # and r3 costs more than r2
        d = p.route(pool, frozenset(), key)
        assert (d.replica_id, d.matched_blocks, d.reason) == ("r2", 0, "bounded")


def test_without_the_cap_the_loaded_holder_keeps_its_prefix():
    p, pool = policy(0.0), pool_of(4)
    key = p.routing_key(prompt(1, 12))
    p.index.record("r0", key.block_hashes)
    shift_prefilling(pool.get("r0"), [pool], 3)
    d = p.route(pool, frozenset(), key)
    assert (d.replica_id, d.matched_blocks, d.reason) == ("r0", 12, "affinity")


def test_with_no_candidate_within_the_bound_the_least_loaded_takes_the_request():
    for compiled in (True, False):
        p, pool = policy(1.0, samples=4, compiled=compiled), pool_of(4)
        key = p.routing_key(prompt(1, 12))
        p.index.record("r0", key.block_hashes)
        shift_prefilling(pool.get("r0"), [pool], 6)
        shift_prefilling(pool.get("r1"), [pool], 5)
        # r2 and r3 (idle) may not take it: the bound, 1 x 12 / 4 = 3, leaves neither r0 nor r1 within it
        d = p.route(pool, {"r2", "r3"}, key)
        assert (d.replica_id, d.matched_blocks, d.reason) == ("r1", 0, "bounded")


def test_the_probe_share_stays_within_the_bound():
    # explore=1: every balance decision takes the costliest drawn, which is the overloaded replica.
    chosen = {}
    for factor in (0.0, 2.0):
        p, pool = policy(factor, samples=4, explore=1.0), pool_of(4)
        load = pool.get("r3")
        load.outstanding, load.prefill_tokens = 20, 50_000
        shift_prefilling(load, [pool], 4)
        chosen[factor] = {p.route(pool, frozenset(), None).replica_id for _ in range(50)}
    assert chosen[0.0] == {"r3"}
    assert "r3" not in chosen[2.0]


@pytest.mark.parametrize("factor", [0.5, -1.0, float("nan")])
def test_a_factor_below_one_is_refused_naming_the_setting(factor):
    with pytest.raises(ValueError, match="max_load_factor .* choose 0 \\(no cap\\) or a factor of at least 1"):
        AffinitySettings(max_load_factor=factor)
    if not math.isnan(factor):
        with pytest.raises(ConfigError, match="router.max_load_factor: found .*; allowed: 0 \\(no cap\\) or a "
                                              "factor of at least 1"):
            parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"max_load_factor": factor}})


def test_the_site_setting_reaches_the_policy_and_its_default_is_the_policys():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"policy": "prefix_affinity"}})
    assert policy_for_site(site.router, site.batching).settings.max_load_factor == AffinitySettings().max_load_factor
    site = parse_site({"site": "t", "models": [{"model_name": "m"}],
                       "router": {"policy": "prefix_affinity", "max_load_factor": 3}})
    assert policy_for_site(site.router, site.batching).settings.max_load_factor == 3.0


def test_a_pool_keeps_its_sum_through_add_and_remove():
    pool = pool_of(3)
    shift_prefilling(pool.get("r1"), [pool], 4)
    shift_prefilling(pool.get("r1"), [pool], -6)  # never below 0: the sum moves by what the count did
    assert (pool.get("r1").prefilling, pool.prefilling_sum) == (0, 0)
    shift_prefilling(pool.get("r2"), [pool], 2)
    pool.add(ReplicaLoad("r9", "m", 0, 8, prefilling=5))
    assert pool.prefilling_sum == 7 and pool.mean_prefilling == 7 / 4
    pool.remove("r2")
    assert pool.prefilling_sum == 5


# ---------------------------------------------------------------- the dispatcher's count

def hello(d: Dispatcher, rid: str, version: str = "") -> None:
    d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=8, max_seq_len=4096,
                                           version=version), 0.0)


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=list(range(64)), max_tokens=4)


def counts(d: Dispatcher) -> dict[str, int]:
    for pool in [*d.pools.values(), *d.version_pools.values()]:  # every pool's running sum is its members' sum
        assert pool.prefilling_sum == sum(c.prefilling for c in pool)
    return {rid: e.load.prefilling for rid, e in sorted(d.replicas.items())}


def test_the_dispatcher_counts_requests_until_their_first_token_in_every_pool():
    d = Dispatcher(make_policy("prefix_affinity", settings=AffinitySettings(max_load_factor=2.0), seed=1),
                   DispatchSettings(max_attempts=3), {"m"})
    hello(d, "r1")
    hello(d, "r2", version="v2")
    for i in range(6):
        d.on_request(b"gw", request(f"q{i}"), 0.1)
    assert sum(counts(d).values()) == 6
    where = {rid: e.replica_id for rid, e in d.inflight.items()}
    d.on_replica_message(where["q0"], TokenChunk(request_id="q0", token_ids=[1]), 0.2)  # first token
    d.on_replica_message(where["q0"], TokenChunk(request_id="q0", token_ids=[2], finished=True), 0.3)
    d.on_abort("q1")  # ended before its first token
    assert sum(counts(d).values()) == 4
    lost = where["q2"]
    on_lost = sum(1 for r in ("q2", "q3", "q4", "q5") if where[r] == lost)
    d.replica_lost(lost, "test", 0.4)  # its requests move to the other replica, counted there
    [(survivor, n)] = counts(d).items()
    assert n == 4 and survivor != lost and on_lost >= 1
    assert d.pools["m"].prefilling_sum == 4
    hello(d, lost)  # back, empty
    assert counts(d)[lost] == 0 and d.pools["m"].prefilling_sum == 4
