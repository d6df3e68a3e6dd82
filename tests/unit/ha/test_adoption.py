"""What a new leader adopts and keeps with several routers (agent/adoption.py): pure decisions."""

from __future__ import annotations

from exaserve_hpc.agent.adoption import adopt, adoptable_ranks, backends, former_leaders, must_restart

R0, R1, R2 = "tcp://a:5001", "tcp://b:5001", "tcp://c:5001"


def test_a_leader_looks_for_every_router_rank_but_its_own():
    assert adoptable_ranks(3, 0) == [1, 2]
    assert adoptable_ranks(3, 1) == [0, 2]
    assert adoptable_ranks(1, 0) == []


def test_only_this_runs_routers_on_nodes_not_lost_are_adopted():
    info = {"run": "j.0", "node": "nodeb", "backend": R1}
    assert adopt(info, "j.0")
    assert adopt(info, "j.0", lost_nodes=("nodea",))
    assert not adopt(info, "j.0", lost_nodes=("nodeb",))  # the old leader's router, its node lost
    assert not adopt(info, "j.1")  # a registration left by the run before a requeue
    assert not adopt(None, "j.0") and not adopt({}, "j.0")


def test_a_replica_whose_routers_survive_is_kept():
    assert not must_restart([R0, R1, R2], [R1, R2])  # the leader's node lost: r1 and r2 still connected
    assert not must_restart([R0, R1, R2], [R2, R1])  # order does not matter (the new leader's router first)
    assert not must_restart([R0, R1, R2], [R0, R1, R2])  # a controller restored with the same routers


def test_a_replica_that_cannot_reach_a_wanted_router_restarts():
    assert must_restart([R0], [R1])  # one router, and the new leader's is another
    assert must_restart([R0, R1], [R1, R2])  # R2 would never see it: connections are made at start
    assert must_restart([R0, R1], [])


def test_a_single_router_spec_is_its_backend():
    assert backends(R0, []) == [R0]
    assert backends(R0, [R0, R1]) == [R0, R1]


def test_the_routers_of_every_former_leaders_node_are_left_out():
    assert former_leaders({}, "nodeb") == []  # the first leader
    assert former_leaders({"node": "nodea"}, "nodeb") == ["nodea"]
    assert former_leaders({"node": "nodeb", "former_nodes": ["nodea"]}, "nodec") == ["nodea", "nodeb"]
    assert former_leaders({"node": "nodeb", "former_nodes": ["nodea"]}, "nodea") == ["nodeb"]  # never its own
