"""Load-weighted balancing: the replica pool and the power-of-two-choices policy."""

from __future__ import annotations

from collections import Counter

import pytest

from exaserve_hpc.router.balancing import PowerOfTwo, ReplicaLoad, ReplicaPool, WeightSettings, replica_cost
from exaserve_hpc.router.policies import make_policy


def pool_of(*loads: ReplicaLoad) -> ReplicaPool:
    pool = ReplicaPool()
    for load in loads:
        pool.add(load)
    return pool


def test_pool_add_remove_keeps_random_access_and_latency_sum():
    pool = pool_of(*(ReplicaLoad(f"r{i}", "m", 0, 8, latency_ewma_ms=10.0 * i) for i in range(4)))
    pool.remove("r1")
    assert sorted(c.replica_id for c in pool) == ["r0", "r2", "r3"]
    assert {pool[i].replica_id for i in range(len(pool))} == {"r0", "r2", "r3"}
    assert pool.get("r3").replica_id == "r3" and pool.get("r1") is None and "r1" not in pool
    assert pool.mean_latency_ms == pytest.approx(50 / 3)
    pool.set_latency(pool.get("r0"), 40.0)
    assert pool.mean_latency_ms == pytest.approx(30.0)


def test_cost_grows_with_queue_latency_and_kv_use():
    s = WeightSettings()
    base = replica_cost(ReplicaLoad("a", "m", 1, 8, latency_ewma_ms=10), 10, s)
    assert replica_cost(ReplicaLoad("a", "m", 3, 8, latency_ewma_ms=10), 10, s) > base
    assert replica_cost(ReplicaLoad("a", "m", 1, 8, queue_depth=4, latency_ewma_ms=10), 10, s) > base
    assert replica_cost(ReplicaLoad("a", "m", 1, 8, latency_ewma_ms=30), 10, s) == pytest.approx(3 * base)
    assert replica_cost(ReplicaLoad("a", "m", 1, 8, kv_used=0.9, latency_ewma_ms=10), 10, s) > base


def test_power_of_two_prefers_the_lighter_of_two():
    policy = PowerOfTwo(WeightSettings(explore=0.0), seed=1)
    pool = pool_of(ReplicaLoad("busy", "m", 6, 8), ReplicaLoad("idle", "m", 0, 8))
    assert {policy.choose(pool) for _ in range(50)} == {"idle"}
    assert policy.choose(pool, exclude={"idle"}) == "busy"
    assert policy.choose(pool, exclude={"idle", "busy"}) is None


def test_slow_replica_gets_less_but_never_nothing():
    policy = PowerOfTwo(WeightSettings(explore=0.02), seed=7)
    loads = [ReplicaLoad(f"r{i}", "m", 0, 8, latency_ewma_ms=10.0) for i in range(7)]
    loads.append(ReplicaLoad("slow", "m", 0, 8, latency_ewma_ms=200.0))
    pool = pool_of(*loads)
    counts = Counter(policy.choose(pool) for _ in range(20000))
    assert 0 < counts["slow"] < 0.2 * counts["r0"]


def test_power_of_two_balances_outstanding_work():
    policy = PowerOfTwo(WeightSettings(explore=0.0), seed=3)
    pool = pool_of(*(ReplicaLoad(f"r{i}", "m", 0, 64) for i in range(16)))
    for _ in range(16 * 20):
        pool.get(policy.choose(pool)).outstanding += 1
    spread = [c.outstanding for c in pool]
    assert max(spread) - min(spread) <= 4  # random choice would spread far wider


def test_sampling_falls_back_to_a_scan_when_most_are_excluded():
    policy = PowerOfTwo(seed=0)
    pool = pool_of(*(ReplicaLoad(f"r{i}", "m", 0, 8) for i in range(200)))
    exclude = {f"r{i}" for i in range(199)}
    assert policy.choose(pool, exclude=exclude) == "r199"


def test_make_policy_names_choices():
    assert make_policy("power_of_two").name == "power_of_two"
    assert make_policy("prefix_affinity").name == "prefix_affinity"
    with pytest.raises(ValueError, match="prefix_affinity"):
        make_policy("nope")
