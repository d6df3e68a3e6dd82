"""Heartbeats off the agent's busy path: a real NodeAgent (its loop in a thread, as under `exaserve serve`)
and a real Controller thread over ZeroMQ. The agent's loop is made to hang for 2.5 s (as a slow replica
spawn or pool call under overload would) with the controller's loss at 0.8 s of silence: its heartbeat
thread keeps the node heard, so the controller never declares it lost."""

from __future__ import annotations

import threading
import time

from exaserve_hpc.agent.node_agent import NodeAgent

from tests.unit.controller.test_controller import context, make_controller, wait_for  # noqa: F401 (fixtures)


def test_a_hung_agent_loop_does_not_make_its_node_lost(make_controller, tmp_path):
    controller, _, _ = make_controller(agents=(), replicas=0, model={"min_replicas": 0})
    controller.site.heartbeat.interval, controller.site.heartbeat.grace = 0.2, 0.2  # lost at 0.8 s of silence
    agent = NodeAgent(controller.endpoint, "n1", 0.2, hostname="n1", l2_root=str(tmp_path / "l2"),
                      pool_bytes=1 << 30, l2_capacity=64 << 20)
    hung = threading.Event()
    advance = agent._advance_loads

    def hang_once() -> None:  # the loop's busy part, stuck once
        if not hung.is_set() and "n1" in controller.agents:
            hung.set()
            time.sleep(2.5)
        advance()

    agent._advance_loads = hang_once
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: hung.is_set(), timeout=10, what="the agent's loop to hang")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert "n1" not in controller.lost_at, "the node was declared lost while its loop was busy"
            time.sleep(0.05)
        assert controller.status()["agents"][0]["state"] == "alive"
    finally:
        agent.shutdown(1.0)
        thread.join(10)
    assert not thread.is_alive()
