"""Liveness that overload cannot fake: a real Controller thread, agents as real ZeroMQ DEALER sockets.

Past heartbeat.misses x interval of silence a node is only suspected (status: "silent"); a heartbeat within
heartbeat.grace cancels the loss before anything is torn down (no replica out of routing, nothing restarted).
A node declared lost whose replicas found no other home and that comes back still running them has them
adopted: placed there again as they run, neither stopped nor restarted.
"""

from __future__ import annotations

import time

from exaserve_hpc.protocol import ReplicaEvent, ReplicaStatus, StartReplica, StopReplica, decode

from tests.unit.controller.test_controller import MODEL, context, make_controller, wait_for  # noqa: F401 (fixtures)


def serving_replica(controller, agent) -> str:
    agent.hello()
    start = agent.expect(StartReplica)
    agent.send(ReplicaEvent(agent_id=agent.agent_id, replica_id=start.replica_id, state="serving"))
    wait_for(lambda: controller.serving_count() == 1, what="the replica serving")
    return start.replica_id


def beat(agent, rid: str, seconds: float, every: float = 0.1) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        agent.heartbeat(replicas=[ReplicaStatus(replica_id=rid, model=MODEL, state="serving", pid=4242)])
        time.sleep(every)


def untouched(agent, rid: str, seconds: float) -> None:
    """Neither stopped nor started again in `seconds` (other replicas, e.g. the model's minimum, may start)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if agent.socket.poll(50):
            message = decode(agent.socket.recv())
            assert not (isinstance(message, (StartReplica, StopReplica)) and message.replica_id == rid), message


def agent_state(controller, agent_id: str) -> str:
    return next(a["state"] for a in controller.status()["agents"] if a["agent_id"] == agent_id)


def test_a_heartbeat_within_the_grace_cancels_the_loss_before_anything_is_torn_down(make_controller):
    controller, router, (agent,) = make_controller(agents=("a",), replicas=1)
    controller.site.heartbeat.interval, controller.site.heartbeat.grace = 0.2, 2.0  # suspected at 0.6 s
    rid = serving_replica(controller, agent)
    beat(agent, rid, 0.5)
    time.sleep(1.2)  # silent: past misses x interval, within the grace
    assert agent_state(controller, "a") == "silent"
    beat(agent, rid, 0.5)
    assert agent_state(controller, "a") == "alive"
    assert controller.lost_at == {} and router.lost == [], router.lost
    untouched(agent, rid, 0.5)
    assert controller.replicas[rid].state.value == "serving" and controller.replicas[rid].agent_id == "a"


def test_replicas_of_a_node_that_comes_back_are_adopted_not_restarted(make_controller):
    controller, router, (agent,) = make_controller(agents=("a",), replicas=1)
    controller.site.heartbeat.interval, controller.site.heartbeat.grace = 0.2, 0.2  # lost at 0.8 s
    rid = serving_replica(controller, agent)
    beat(agent, rid, 0.3)
    wait_for(lambda: "a" in controller.lost_at, timeout=5, what="the node declared lost")
    assert (rid, "node a lost") in router.lost
    assert controller.replicas[rid].assignment is None  # the only node: nowhere else to go
    beat(agent, rid, 0.6)
    record = controller.replicas[rid]
    assert record.agent_id == "a" and record.assignment is not None and record.state.value == "serving"
    assert record.detail.startswith("adopted"), record.detail
    assert agent_state(controller, "a") == "alive"
    untouched(agent, rid, 0.5)  # neither stopped as a stale copy nor started again
