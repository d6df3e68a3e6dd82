"""`router.policy: random` (router/random_choice.py), the extension example of docs/extending.md: accepted by
the site schema through the registry alone, uniform over the usable replicas, repeatable with a seed."""

from __future__ import annotations

from collections import Counter

import pytest

from exaserve_hpc.config.schema import ConfigError, parse_site
from exaserve_hpc.router.balancing import ReplicaLoad
from exaserve_hpc.router.policies import make_policy, policy_for_site
from exaserve_hpc.router.random_choice import RandomChoice

LOADS = [ReplicaLoad(f"r{i}", "m", 10 * i, 8) for i in range(4)]  # load does not matter to it


def test_the_site_schema_accepts_the_name_the_registry_adds():
    site = parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"policy": "random"}})
    assert isinstance(policy_for_site(site.router, site.batching), RandomChoice)
    with pytest.raises(ConfigError, match="router.policy"):
        parse_site({"site": "t", "models": [{"model_name": "m"}], "router": {"policy": "randm"}})


def test_uniform_over_the_usable_replicas_whatever_their_load():
    policy = make_policy("random", seed=1)
    picks = Counter(policy.choose(LOADS, {"r3"}) for _ in range(3000))
    assert set(picks) == {"r0", "r1", "r2"}
    assert all(900 <= n <= 1100 for n in picks.values()), picks  # 1000 each; 5 sigma is about +-130


def test_a_seed_repeats_the_draws_and_nothing_usable_is_no_replica():
    a, b, c = make_policy("random", seed=7), make_policy("random", seed=7), make_policy("random", seed=8)
    draws = [a.choose(LOADS) for _ in range(50)]
    assert draws == [b.choose(LOADS) for _ in range(50)] != [c.choose(LOADS) for _ in range(50)]
    assert make_policy("random").route(LOADS, {"r0", "r1", "r2", "r3"}).reason == "none"
