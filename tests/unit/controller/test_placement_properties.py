"""Property tests: every placement invariant on random clusters and catalogues."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exaserve_hpc.controller.autoscale import ScaleDecision, apply_scaling
from exaserve_hpc.controller.failover import failover
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.placement import plan_catalogue, plan_site
from exaserve_hpc.controller.rebalance import rebalance
from tests.controller.site_strategies import parts, sites

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(sites())
def test_random_plans_keep_every_invariant(site):
    topo, cat, cap = parts(site)
    plan = plan_site(site)
    assert plan_violations(plan, topo, cat, cap) == []
    placed = plan.replicas_per_model()
    for name, spec in cat.items():
        assert placed.get(name, 0) + plan.unplaced_count(name) == spec.replicas
    assert all(u.reason and u.count > 0 for u in plan.unplaced)
    assert len({a.replica_id for a in plan.assignments}) == len(plan.assignments)


@SETTINGS
@given(sites())
def test_spread_plan_keeps_every_invariant(site):
    topo, cat, cap = parts(site)
    plan = plan_catalogue(topo, cat, cap, device_fit="spread")
    assert plan_violations(plan, topo, cat, cap) == []


@SETTINGS
@given(sites())
def test_planning_is_deterministic(site):
    assert plan_site(site).to_dict() == plan_site(site).to_dict()


@SETTINGS
@given(sites(), st.data())
def test_failover_keeps_invariants_and_moves_only_the_lost(site, data):
    topo, cat, cap = parts(site)
    plan = plan_site(site)
    names = [n.name for n in topo.nodes]
    lost = set(data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=max(1, len(names) // 2))))
    decision = failover(plan, topo, cat, lost, cap)
    new = decision.plan
    # spread: see plan_violations; unaffected replicas are not re-spread by failover
    assert plan_violations(new, topo, cat, cap, spread=False) == []
    assert lost <= new.down_nodes
    assert not new.on_nodes(lost)
    before, after = plan.by_id(), new.by_id()
    hit = {a.replica_id for a in plan.on_nodes(lost)}
    for rid, a in before.items():
        if rid not in hit:
            assert after[rid] == a, "an unaffected replica moved"
    assert {r.replica_id for r in decision.replacements} == hit
    for r in decision.replacements:
        assert (r.new is None) == (r.replica_id not in after)
        assert r.reason
    lost_unplaced = sum(u.count for u in decision.unplaced)
    assert len(after) == len(before) - lost_unplaced


@SETTINGS
@given(sites(), st.data())
def test_scaling_keeps_invariants(site, data):
    topo, cat, cap = parts(site)
    plan = plan_site(site)
    counts = plan.replicas_per_model()
    decisions = []
    for name in cat:
        target = data.draw(st.integers(0, 30))
        decisions.append(ScaleDecision(name, counts.get(name, 0), target, 0.5, "test"))
    result = apply_scaling(plan, topo, cat, decisions, cap)
    # spread off: removals free room that unchanged models do not move into (see plan_violations)
    assert plan_violations(result.plan, topo, cat, cap, spread=False) == []
    got = result.plan.replicas_per_model()
    for d in decisions:
        missing = sum(u.count for u in result.unplaced if u.model == d.model)
        assert got.get(d.model, 0) + missing == d.target
    assert len({a.replica_id for a in result.plan.assignments}) == len(result.plan.assignments)
    assert not {a.replica_id for a in result.started} & set(plan.by_id())


def _spread(plan, topo, model) -> int:
    """Most minus fewest replicas of a model over the fault groups."""
    per_group = Counter({g.name: 0 for g in topo.groups})
    per_group.update(topo.node(a.node).fault_group for a in plan.assignments if a.model == model)
    return max(per_group.values()) - min(per_group.values())


@SETTINGS
@given(sites(), st.integers(0, 5))
def test_rebalance_keeps_invariants_and_raises_each_source(site, moves):
    topo, cat, cap = parts(site)
    plan = plan_site(site)
    decision = rebalance(plan, topo, cat, cap, moves)
    assert len(decision.moves) <= moves
    # A move inside a fault group can free room in a group that was full, which makes the
    # plan's spread improvable without making it worse: check "never wider", not "optimal".
    assert plan_violations(decision.plan, topo, cat, cap, spread=False) == []
    for model in cat:
        assert _spread(decision.plan, topo, model) <= max(1, _spread(plan, topo, model)), model
    assert decision.plan.replicas_per_model() == plan.replicas_per_model()
    for m in decision.moves:
        assert m.start.model == m.drain.model and m.start.node != m.drain.node
        assert m.steps[0].startswith("start") and m.steps[2].startswith("drain")
    assert Counter(decision.plan.replicas_per_node()).total() == Counter(plan.replicas_per_node()).total()
