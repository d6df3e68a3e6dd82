"""pick_for_removal: the scale-down choice, checked against the rule it states, one choice at a time."""

from __future__ import annotations

import random
import time

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.controller.fleet_state import ReplicaRecord, in_flight, pick_for_removal
from exaserve_hpc.controller.plan import replica_index

MODEL = "m"


def by_the_rule(records, routed, count, group_of):
    """The rule as its docstring reads it: each choice rescans what is left (quadratic; the specification)."""
    chosen, left = [], [r for r in records if not r.stopping]
    for _ in range(max(0, min(count, len(left)))):
        per_group: dict[str, int] = {}
        for r in left:
            g = group_of.get(r.agent_id or "", "")
            per_group[g] = per_group.get(g, 0) + 1
        best = min(left, key=lambda r: (r.serving, in_flight(routed, r.replica_id),
                                        -per_group[group_of.get(r.agent_id or "", "")], -replica_index(r.replica_id)))
        chosen.append(best.replica_id)
        left.remove(best)
    return chosen


def fleet(rng: random.Random, n: int, nodes: int, groups: int):
    group_of = {f"n{k}": f"g{k % groups}" for k in range(nodes)}
    records, routed = [], {}
    for i in rng.sample(range(4 * n), n):
        r = ReplicaRecord(f"{MODEL}/r{i:04d}", MODEL, agent_id=f"n{rng.randrange(nodes + 1)}",  # one node unknown
                          state=rng.choice([ReplicaState.SERVING] * 4 + [ReplicaState.LOADING]))
        r.stopping = rng.random() < 0.05
        records.append(r)
        routed[r.replica_id] = {"outstanding": rng.choice([0, 0, 1, 2, 5]), "queue_depth": rng.choice([0, 3])}
    return records, routed, group_of


def test_matches_the_rule_on_random_fleets():
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(0, 40)
        records, routed, group_of = fleet(rng, n, rng.randint(1, 8), rng.randint(1, 4))
        count = rng.randint(0, n + 2)
        chosen = pick_for_removal(records, routed, count, group_of)
        assert chosen == by_the_rule(records, routed, count, group_of), trial


def test_spread_holds_when_all_are_alike():
    """Idle replicas, two groups of 6 and 2: removals come from the fuller group until they are even."""
    group_of = {"a": "g0", "b": "g1"}
    records = [ReplicaRecord(f"{MODEL}/r{i:04d}", MODEL, agent_id="a" if i < 6 else "b",
                             state=ReplicaState.SERVING) for i in range(8)]
    chosen = pick_for_removal(records, {}, 5, group_of)
    assert chosen[:4] == [f"{MODEL}/r{i:04d}" for i in (5, 4, 3, 2)]  # g0 6 -> 2, newest first
    assert chosen[4] == f"{MODEL}/r0007"  # 2 and 2: the newest of either


def test_a_large_scale_down_is_not_quadratic():
    """3,072 replicas over 32 groups down to 4: well under the seconds the rescan took."""
    rng = random.Random(1)
    records, routed, group_of = fleet(rng, 3072, 256, 32)
    started = time.process_time()
    chosen = pick_for_removal(records, routed, 3068, group_of)
    assert len(chosen) == len(set(chosen)) == min(3068, sum(not r.stopping for r in records))
    assert time.process_time() - started < 0.5
