"""The controller survives any message: a real Controller thread and real ZeroMQ DEALER sockets.

A heartbeat naming a real replica in a state no replica can be in (it used to raise in the handler and end
the controller thread), frames that do not decode, and messages of the wrong types are each dropped and
logged once; the controller keeps answering the real agent; a peer that keeps sending them is refused for
a while. /health names a stopped controller thread (503) through the real gateway app.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from fastapi.testclient import TestClient

from exaserve_hpc.protocol import AgentHeartbeat, HeartbeatAck, ReplicaEvent, ReplicaStatus, StartReplica
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.gateway.app import create_app
from exaserve_hpc.peer_guard import PeerGuard

from tests.unit.controller.test_controller import MODEL, FakeAgent, context, make_controller, wait_for  # noqa: F401 (fixtures)


def bad_heartbeat(agent_id: str, replica_id: str) -> AgentHeartbeat:
    return AgentHeartbeat(agent_id=agent_id, seq=99, replicas=[
        ReplicaStatus(replica_id=replica_id, model=MODEL, state="exploded", pid=4242)])


def acked(agent: FakeAgent, timeout: float = 5.0) -> bool:
    agent.heartbeat()
    try:
        agent.expect(HeartbeatAck, timeout, where=lambda m: m.seq == agent.seq)
        return True
    except AssertionError:
        return False


def test_a_heartbeat_in_an_unknown_state_is_dropped_and_the_controller_keeps_serving(make_controller, caplog):
    controller, _, (agent,) = make_controller(agents=("a",), replicas=1)
    agent.hello()
    start = agent.expect(StartReplica)
    rogue = FakeAgent(agent.socket.context, controller.endpoint, "rogue")
    rogue.hello()
    with caplog.at_level(logging.WARNING, logger="exaserve.controller"):
        for _ in range(3):  # logged once, however often it comes
            rogue.send(bad_heartbeat("rogue", start.replica_id))
        rogue.socket.send(b"\xc1 not msgpack")
        rogue.socket.send(msgspec.msgpack.encode({"t": "agent_hb", "agent_id": 5, "seq": "x"}))  # wrong types
        assert acked(agent), "the controller stopped answering its agent after a bad message"
        assert acked(rogue), "a peer is not refused for a few bad messages"
    assert controller._thread.is_alive() and controller.liveness() == []
    lines = [r.getMessage() for r in caplog.records if "bad message" in r.getMessage()]
    assert sum("exploded" in line for line in lines) == 1, lines
    assert any("undecodable" in line for line in lines), lines
    status = controller.status()["controller"]
    assert status["liveness"] == "ok" and status["dropped_messages"] >= 5
    # the real replica is untouched: still placed on its agent, not stopped or failed
    record = controller.replicas[start.replica_id]
    assert record.agent_id == "a" and not record.state.terminal


def test_a_peer_past_the_limit_is_refused_while_others_are_served(make_controller, caplog):
    controller, _, (agent,) = make_controller(agents=("a",), replicas=1)
    agent.hello()
    start = agent.expect(StartReplica)
    rogue = FakeAgent(agent.socket.context, controller.endpoint, "rogue")
    rogue.hello()
    assert acked(rogue)
    with caplog.at_level(logging.WARNING, logger="exaserve.controller"):
        for _ in range(controller.peers.limit + 1):
            rogue.send(bad_heartbeat("rogue", start.replica_id))
        assert not acked(rogue, timeout=1.0), "a peer past the limit is still answered"
    assert any("refusing peer b'rogue'" in r.getMessage() for r in caplog.records)
    assert acked(agent)
    assert controller.status()["controller"]["refused_peers"] == ["rogue"]


def test_an_oversized_frame_is_refused_before_it_is_read(make_controller):
    controller, _, (agent,) = make_controller(agents=("a",), replicas=1)
    agent.hello()
    agent.expect(StartReplica)
    rogue = FakeAgent(agent.socket.context, controller.endpoint, "rogue")
    rogue.socket.send(b"\x00" * (32 << 20))  # past MAX_MESSAGE_BYTES: ZeroMQ drops the connection
    time.sleep(1.0)
    assert acked(agent) and controller.liveness() == []
    assert controller.status()["controller"]["dropped_messages"] == 0  # never read, so never decoded


def test_a_stopped_router_thread_is_named_and_nothing_counts_as_serving(make_controller):
    controller, router, (agent,) = make_controller(agents=("a",), replicas=1)
    agent.hello()
    start = agent.expect(StartReplica)
    agent.send(ReplicaEvent(agent_id="a", replica_id=start.replica_id, state="serving"))
    wait_for(lambda: controller.serving_count() == 1, what="the replica serving")
    router.routing = lambda: False  # RouterPort: its loop ended (ZmqRouter.routing reads its thread)
    assert controller.liveness() == ["router thread stopped"] and controller.serving_count() == 0
    assert controller.status()["controller"]["liveness"] == ["router thread stopped"]


def test_peer_guard_refuses_for_a_while_then_forgives():
    guard = PeerGuard(limit=2, window=10.0, refuse_for=5.0)
    assert guard.bad(b"p", "x", "first", 0.0) and guard.bad(b"p", "x", "again", 1.0) is None
    assert not guard.refused(b"p", 1.5)
    assert "refusing" in guard.bad(b"p", "x", "third", 2.0)
    assert guard.refused(b"p", 6.9) and not guard.refused(b"p", 7.1)
    assert not guard.refused(b"q", 3.0)


def test_health_is_503_naming_a_stopped_controller_thread(make_controller):
    controller, _, (agent,) = make_controller(agents=("a",), replicas=1)
    agent.hello()
    start = agent.expect(StartReplica)
    agent.send(ReplicaEvent(agent_id="a", replica_id=start.replica_id, state="serving"))
    wait_for(lambda: controller.serving_count() == 1, what="the replica serving")
    client = RouterClient("tcp://127.0.0.1:1", [ModelInfo(name=MODEL, max_seq_len=2048, created=0)],
                          status=controller.status, ready=lambda: controller.serving_count() > 0)
    app = create_app(client, controller.site)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        controller._stop.set()  # the controller thread ends (as if it had died)
        controller._thread.join(5)
        answer = http.get("/health")
    assert answer.status_code == 503, answer.text
    assert "controller thread stopped" in answer.json()["reason"]
