"""The controller's core, driven as the simulator drives it: messages and a clock in, effects out; no socket,
no thread (controller/core.py)."""

from __future__ import annotations

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import (AgentHeartbeat, AgentHello, GpuInfo, HeartbeatAck, MemoryPoolStatus, ReplicaEvent,
                                   Shutdown, StartReplica)
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.core import ControllerCore

GiB = 1 << 30


class Router(RouterPortStub):
    backend_endpoint, frontend_endpoint = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"

    def __init__(self):
        self.lost: list[str] = []

    def snapshot(self) -> dict:
        return {"replicas": []}

    def replica_lost(self, replica_id: str, why: str) -> None:
        self.lost.append(replica_id)


def site(tmp_path):
    return parse_site({
        "site": "core", "run_dir": str(tmp_path / "run"),
        "cluster": {"nodes": 2, "nodelist": "n[1-2]", "gpus_per_node": 2, "gpu_memory": "80GiB"},
        "heartbeat": {"interval": 1.0, "misses": 3, "grace": 2.0},
        "scheduler": {"cooldown_period": 3600},
        "weight_cache": {"l3_path": str(tmp_path / "models")},
        "models": [{"model_name": "m", "engine": "echo", "replicas": 2, "min_replicas": 2,
                    "gpu_memory_utilization": 0.9}]})


def hello(node: str) -> AgentHello:
    gpus = [GpuInfo(index=i, name="H100", memory_total=80 * GiB) for i in range(2)]
    return AgentHello(agent_id=node, hostname=node, pid=1, gpus=gpus, host_memory_total=512 * GiB,
                      memory=MemoryPoolStatus(block_size=GiB, total=[80 * GiB] * 2, free=[80 * GiB] * 2))


def starts(effects) -> dict[str, str]:
    return {message.replica_id: node for node, message in effects if isinstance(message, StartReplica)}


def test_messages_and_a_clock_in_orders_out_and_a_silent_node_s_replicas_move(tmp_path):
    now = [100.0]
    core = ControllerCore(site(tmp_path), Router(), clock=lambda: now[0], expected_agents=["n1", "n2"])
    with core.fleet.lock:
        core.handle("n1", hello("n1"))
        core.handle("n2", hello("n2"))
        core.tick(now[0])
    first = starts(core.take_effects())
    assert sorted(first.values()) == ["n1", "n2"]  # spread: one replica per node
    for rid, node in first.items():
        core.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="serving"))
    assert core.take_effects() == []  # events answer nothing

    now[0] += 1.0
    core.handle("n2", AgentHeartbeat(agent_id="n2", seq=1))
    assert core.take_effects() == [("n2", HeartbeatAck(seq=1))]

    # n1 stays silent: after 3 missed heartbeats it is suspect, after the grace lost, its replica goes to n2
    for step in range(1, 9):
        now[0] = 101.0 + step
        core.handle("n2", AgentHeartbeat(agent_id="n2", seq=1 + step))
        with core.fleet.lock:
            core.tick(now[0])
    lost = next(rid for rid, node in first.items() if node == "n1")
    assert core.agents["n1"].lost and lost in core.router.lost
    assert starts(core.take_effects()) == {lost: "n2"}


def test_a_controller_that_is_not_surely_the_leader_hands_out_nothing(tmp_path):
    core = ControllerCore(site(tmp_path), Router(), clock=lambda: 100.0, placement_grace=0)
    with core.fleet.lock:
        core.handle("n1", hello("n1"))
    core.acting = lambda: False  # the HA gate (ha/election.py): deposed
    with core.fleet.lock:
        core.shut_down_fleet(5.0)
    assert core.take_effects() == []
    core.acting = lambda: True
    with core.fleet.lock:
        core.shut_down_fleet(5.0)
    assert core.take_effects() == [("n1", Shutdown(drain_timeout=5.0))]


def test_the_orders_it_hands_out_are_counted_by_kind(tmp_path):
    from exaserve_hpc import metrics

    def count(order):
        return metrics.REGISTRY.get_sample_value("exaserve_controller_orders_total", {"order": order}) or 0.0

    starts, acks = count("StartReplica"), count("HeartbeatAck")
    core = ControllerCore(site(tmp_path), Router(), clock=lambda: 100.0, placement_grace=0)
    with core.fleet.lock:
        core.handle("n1", hello("n1"))
        core.handle("n1", AgentHeartbeat(agent_id="n1", seq=1))
    sent = core.take_effects()
    assert count("StartReplica") - starts == len(starts_of := [m for _, m in sent if isinstance(m, StartReplica)])
    assert starts_of and count("HeartbeatAck") == acks  # an acknowledgement is not an order
