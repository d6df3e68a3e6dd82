"""Rebalancer (bounded moves raising the worst node's headroom) and OOM guard (lowest priority first)."""

from __future__ import annotations

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.failover import failover
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.oom_guard import MemoryReading, oom_guard, replica_priorities
from exaserve_hpc.controller.placement import plan_site
from exaserve_hpc.controller.plan import Plan
from exaserve_hpc.controller.rebalance import rebalance, rebalance_due
from exaserve_hpc.topology import topology_from_site

GiB = 2**30


def _site(models, nodes=4, cap=8):
    return parse_site({"site": "t", "cluster": {"nodes": nodes, "gpus_per_node": 2, "gpu_memory": "80GiB",
                                                "fault_group_size": nodes},
                       "scheduler": {"max_replicas_per_node": cap}, "models": models})


def test_rebalance_moves_load_off_the_fullest_node_start_then_drain():
    site = _site([{"model_name": "a", "replicas": 12, "gpu_memory_utilization": 0.2}])
    topo, cat = topology_from_site(site), catalogue_from_site(site)
    plan = plan_site(site)
    # lose node3 then bring it back (as a replacement would): its replicas piled onto the others
    crowded = failover(plan, topo, cat, ["node3"], 8).plan
    crowded = Plan(crowded.site, crowded.assignments, crowded.memory_used, crowded.memory_total,
                   crowded.fault_group_of, crowded.unplaced, frozenset())
    decision = rebalance(crowded, topo, cat, 8, max_moves=2)
    assert len(decision.moves) == 2
    for m in decision.moves:
        assert m.start.node == "node3" and m.drain.node != "node3"
        assert m.start.replica_id != m.drain.replica_id and m.start.replica_id.startswith("a/r")
        assert [s.split()[0] for s in m.steps] == ["start", "wait", "drain", "stop"]
    assert decision.plan.replicas_per_node()["node3"] == 2
    assert plan_violations(decision.plan, topo, cat, 8) == []
    assert "budget" in decision.reason


def test_rebalance_stops_when_balanced_and_says_why():
    site = _site([{"model_name": "a", "replicas": 8, "gpu_memory_utilization": 0.2}])
    topo, cat = topology_from_site(site), catalogue_from_site(site)
    decision = rebalance(plan_site(site), topo, cat, 8, max_moves=4)
    assert decision.moves == [] and "no move raises" in decision.reason


def test_rebalance_due():
    assert rebalance_due(None, 0.0, 30.0) and rebalance_due(0.0, 30.0, 30.0) and not rebalance_due(0.0, 29.9, 30.0)


def _readings(plan, node, used_fraction):
    return [MemoryReading(node, d, int(used_fraction * t), t) for d, t in enumerate(plan.memory_total[node])]


def test_oom_guard_evicts_lowest_priority_first_and_never_the_last_replica():
    site = parse_site({"site": "t", "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_memory": "80GiB"},
                       "scheduler": {"max_replicas_per_node": 8},
                       "models": [{"model_name": "low", "replicas": 2, "gpu_memory_utilization": 0.2, "priority": 10},
                                  {"model_name": "high", "replicas": 2, "gpu_memory_utilization": 0.2, "priority": 90},
                                  {"model_name": "solo", "replicas": 1, "gpu_memory_utilization": 0.1, "priority": 0}]})
    plan, cat = plan_site(site), catalogue_from_site(site)
    # short by ~0.25 of the GPU: two evictions of 0.2 each
    decision = oom_guard(plan, cat, _readings(plan, "node0", 1.2), {}, margin=0.05)
    assert [e.model for e in decision.evictions] == ["low", "high"]
    assert decision.evictions[0].replica_id == "low/r0001"  # newest first among equals
    assert all("short by" in e.reason for e in decision.evictions)
    # far short: everything but the last replica of each model goes, and it says what is left
    deep = oom_guard(plan, cat, _readings(plan, "node0", 2.0), {}, margin=0.05)
    assert sorted(e.model for e in deep.evictions) == ["high", "low"]
    assert "last of high, low, solo" in deep.unresolved[0]
    assert oom_guard(plan, cat, _readings(plan, "node0", 0.5), {}).evictions == []


def test_priority_blends_importance_demand_and_size():
    site = _site([{"model_name": "a", "priority": 50, "weight_bytes": "10GB"},
                  {"model_name": "b", "priority": 50, "weight_bytes": "10GB"},
                  {"model_name": "c", "priority": 50, "weight_bytes": "100GB", "tensor_parallel": 2}])
    cat = catalogue_from_site(site)
    p = replica_priorities(cat, {"a": 4, "b": 4, "c": 4}, {"a": 100.0, "b": 10.0})
    assert p["a"] > p["b"]  # busier per replica
    assert p["c"] > p["b"] - 0.3 * (10 / 100) and p["c"] > replica_priorities(cat, {"c": 4}, {})["b"]
