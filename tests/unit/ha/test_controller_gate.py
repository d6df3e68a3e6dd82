"""The controller's HA gate (no sockets): a controller that is not surely the leader decides nothing and
sends nothing; a new leader keeps a replica its restored state places where an agent already runs it."""

from __future__ import annotations

from exaserve_hpc.controller_state import ControllerState
from exaserve_hpc.protocol import AgentHeartbeat, ReplicaStatus, StartReplica, StopReplica
from exaserve_hpc.controller.core import ControllerCore
from tests.unit.controller.test_controller_placement import Clock, StubRouter, gpu_site, hello, starts


def test_a_controller_not_acting_places_nothing_and_queues_nothing(tmp_path):
    site = gpu_site(tmp_path)
    leading = {"now": False}
    ctl = ControllerCore(site, StubRouter(), clock=Clock(), expected_agents=site.cluster.hostnames())
    ctl.acting = lambda: leading["now"]
    for node in site.cluster.hostnames():
        ctl.handle(node, hello(site, node))
    ctl.tick(200.0)
    assert not ctl.agents and not ctl.fleet.take_outbox()
    leading["now"] = True
    for node in site.cluster.hostnames():
        ctl.handle(node, hello(site, node))
    assert starts(ctl), "once leading, the same hellos place the fleet"


def test_a_new_leader_keeps_a_restored_replica_where_it_runs(tmp_path):
    site = gpu_site(tmp_path)
    nodes = site.cluster.hostnames()
    first = ControllerCore(site, StubRouter(), clock=Clock(), expected_agents=nodes)
    for node in nodes:
        first.handle(node, hello(site, node))
    placed = starts(first)
    rid, (node, spec) = next(iter(placed.items()))
    state = ControllerState("j", 0, 0.0, placement={r: (s.model, n) for r, (n, s) in placed.items()})

    second = ControllerCore(site, StubRouter(), clock=Clock(), expected_agents=nodes)
    second.restore(state)
    second.handle(node, hello(site, node))  # the other agents have not re-registered yet: nothing placed
    second.handle(node, AgentHeartbeat(agent_id=node, seq=1, replicas=[
        ReplicaStatus(replica_id=rid, model=spec.model, state="serving", pid=42)]))
    sent = second.fleet.take_outbox()
    assert not [m for _, m in sent if isinstance(m, StopReplica)], sent
    for other in nodes:
        if other != node:
            second.handle(other, hello(site, other))
    again = {m.replica_id: n for n, m in second.fleet.take_outbox() if isinstance(m, StartReplica)}
    assert again.get(rid) == node  # asked again where it runs: its agent answers "already here"
