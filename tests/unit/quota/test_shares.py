"""Guarantees, borrowing and fair share: the pure policy (the gateway under contention: tests/gateway/test_gateway_quota.py)."""

from __future__ import annotations

import pytest

from exaserve_hpc.quota.shares import ADMIT, DecayedUsage, GroupShare, SharePolicy

SHARES = {"owner": GroupShare(0.5, 0.75), "burst": GroupShare(0.0, 1.0)}


def test_a_group_under_its_guarantee_is_admitted_even_when_others_fill_the_model():
    policy = SharePolicy(SHARES, half_life=60)
    assert policy.decide("owner", {"burst": 8}, capacity=8, now=0) == ADMIT
    assert policy.decide("owner", {"burst": 8, "owner": 3}, capacity=8, now=0) == ADMIT  # 3 < 4 guaranteed
    assert policy.decide("owner", {"burst": 8, "owner": 4}, capacity=8, now=0) == "borrowing_preempted"


def test_idle_guaranteed_slots_are_borrowed_up_to_the_ceiling_and_taken_back_by_admission():
    policy = SharePolicy(SHARES, half_life=60)
    assert policy.decide("burst", {"burst": 7}, capacity=8, now=0) == ADMIT  # the owner's 4 idle slots lent
    assert policy.decide("burst", {"burst": 8}, capacity=8, now=0) == "burst_ceiling"
    assert policy.decide("owner", {"owner": 6}, capacity=8, now=0) == "burst_ceiling"  # 0.75 x 8
    # the owner comes back: the model is full, so borrowing stops at once
    assert policy.decide("burst", {"burst": 5, "owner": 3}, capacity=8, now=0) == "borrowing_preempted"
    assert policy.decide("burst", {"burst": 4, "owner": 3}, capacity=8, now=0) == ADMIT


def test_fair_share_gives_the_lighter_user_more_of_the_spare_slots():
    shares = {"a": GroupShare(0.0, 1.0), "b": GroupShare(0.0, 1.0), "g": GroupShare(0.2, 1.0)}
    policy = SharePolicy(shares, half_life=60)
    policy.usage.add("a", 9_000, now=0)
    policy.usage.add("b", 1_000, now=0)
    # 10 slots, nobody guaranteed in flight: a heavy user holding 3 is stopped, the light one holding 5 is not
    assert policy.decide("a", {"a": 3, "b": 5}, capacity=10, now=0) == "fair_share"
    assert policy.decide("b", {"a": 3, "b": 5}, capacity=10, now=0) == ADMIT
    # a day later (many half-lives) the history is forgotten only relative to new usage
    policy.usage.add("b", 50_000, now=86_400)
    assert policy.decide("b", {"a": 4, "b": 5}, capacity=10, now=86_400) == "fair_share"


def test_decayed_usage_halves_every_half_life():
    usage = DecayedUsage(half_life=10)
    usage.add("g", 100, now=0)
    assert usage.value("g", 10) == pytest.approx(50) and usage.value("g", 30) == pytest.approx(12.5)


def test_an_older_amount_is_decayed_to_the_groups_time_and_the_usage_is_not_decayed_twice():
    usage = DecayedUsage(half_life=100)
    usage.add("g", 1000, now=1000)
    usage.add("g", 1, now=500)  # five half-lives older than the group's time
    assert usage.value("g", 1000) == pytest.approx(1000 + 1 / 32)
    usage.add("g", 64, now=900)  # one half-life older
    assert usage.value("g", 1100) == pytest.approx((1000 + 1 / 32 + 32) / 2)
    timeless = DecayedUsage(half_life=0)  # no decay at all
    timeless.add("g", 10, now=5)
    timeless.add("g", 10, now=1)
    assert timeless.value("g", 100) == 20


def test_config_refuses_guarantees_over_one_and_a_ceiling_below_the_guarantee():
    from exaserve_hpc.config.schema import ConfigError, parse_site
    base = {"site": "s", "models": [{"model_name": "m"}]}
    with pytest.raises(ConfigError, match="guaranteed_share add up to 1.2; at most 1"):
        parse_site({**base, "quota_groups": [{"name": "a", "guaranteed_share": 0.6},
                                             {"name": "b", "guaranteed_share": 0.6}]})
    with pytest.raises(ConfigError, match=r"burst_share \(0.2\) is below guaranteed_share \(0.5\)"):
        parse_site({**base, "quota_groups": [{"name": "a", "guaranteed_share": 0.5, "burst_share": 0.2}]})

