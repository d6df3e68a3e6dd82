"""A job-wide stop: once the controller knows (Controller.stopping(), from the stop signal on), a replica its
agent stops is neither re-placed nor moved, even before the controller's own Shutdown has gone out (under
Slurm every task gets the signal, and agents may drain first: "stopped by n2 without being asked; moving it")."""

from __future__ import annotations

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import AgentHello, MemoryPoolStatus, ReplicaEvent, StartReplica
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.core import ControllerCore

GiB = 1 << 30


class StubRouter(RouterPortStub):
    """Nothing routed (router/port.py's stub as it is)."""


def started(ctl) -> dict[str, str]:
    return {m.replica_id: node for node, m in ctl.fleet.take_outbox() if isinstance(m, StartReplica)}


def fleet(tmp_path):
    site = parse_site({"site": "stop2", "run_dir": str(tmp_path / "run"),
                       "cluster": {"nodes": 2, "nodelist": "a,b", "host_memory": "8GiB"},
                       "scheduler": {"max_replicas_per_node": 4, "cooldown_period": 3600},
                       "weight_cache": {"l3_path": str(tmp_path / "models")},
                       "models": [{"model_name": "m", "engine": "echo", "replicas": 2, "min_replicas": 2,
                                   "max_seq_len": 256}]})
    ctl = ControllerCore(site, StubRouter(), clock=lambda: 100.0, expected_agents=["a", "b"])
    for node in ("a", "b"):
        pool = [4 * GiB]
        ctl.handle(node, AgentHello(agent_id=node, hostname=node, pid=1, host_memory_total=8 * GiB,
                                    memory=MemoryPoolStatus(block_size=GiB, total=pool, free=pool)))
    sent = started(ctl)
    for rid, node in sent.items():
        ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="serving"))
    return ctl, sent


def test_a_replica_stopped_by_its_agent_during_a_stop_is_not_moved(tmp_path):
    ctl, sent = fleet(tmp_path)
    (rid, node), *_ = sent.items()
    ctl.stopping()  # the stop signal; shutdown()'s Shutdown broadcast has not run on the controller thread
    ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="stopped", detail="agent shutting down"))
    ctl.tick(100.0)
    assert started(ctl) == {}
    assert ctl.replicas[rid].assignment is not None  # not unplaced for a move either


def test_without_a_stop_the_same_event_is_a_graceful_leave_and_moves_the_replica(tmp_path):
    ctl, sent = fleet(tmp_path)
    (rid, node), *_ = sent.items()
    ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="stopped", detail="agent shutting down"))
    assert started(ctl) == {rid: "b" if node == "a" else "a"}
