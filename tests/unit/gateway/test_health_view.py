"""/health is the controller's view (issue 25 item 1): 503 while no replica of any model can serve (its only
agent declared lost, every replica pending), 200 otherwise; and 503 once the gateway is stopping."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.app.routing import fleet_can_serve
from exaserve_hpc.controller.fleet_state import AgentRecord


def controller(replicas: list[tuple[ReplicaState, tuple[str, ...]]], lost: set[str] = frozenset(),
               liveness: list[str] = ()):
    """What fleet_can_serve reads of a Controller: serving_count (0 while the controller or router is down,
    as Controller.serving_count), agents, replicas, the fleet's lock."""
    agents = {n: AgentRecord(n, n, 1, 0.0, lost=n in lost) for _, nodes in replicas for n in nodes}
    records = {f"m/r{i}": SimpleNamespace(state=state, agent_id=nodes[0], assignment=SimpleNamespace(nodes=nodes))
               for i, (state, nodes) in enumerate(replicas)}
    return SimpleNamespace(
        agents=agents, replicas=records, fleet=SimpleNamespace(lock=threading.Lock()),
        serving_count=lambda: 0 if liveness else sum(r.state is ReplicaState.SERVING for r in records.values()))


def test_a_serving_replica_whose_only_agent_is_lost_cannot_serve():
    assert fleet_can_serve(controller([(ReplicaState.SERVING, ("n1",))])) is True
    assert fleet_can_serve(controller([(ReplicaState.SERVING, ("n1",))], lost={"n1"})) is False


def test_every_replica_pending_or_a_stage_on_a_lost_node_is_503_and_one_good_replica_is_200():
    assert fleet_can_serve(controller([(ReplicaState.PENDING, ("n1",)), (ReplicaState.LOADING, ("n2",))])) is False
    # a pipeline replica with a stage on a lost node cannot serve either
    assert fleet_can_serve(controller([(ReplicaState.SERVING, ("n1", "n2"))], lost={"n2"})) is False
    assert fleet_can_serve(controller([(ReplicaState.SERVING, ("n1",)), (ReplicaState.SERVING, ("n2",))],
                                      lost={"n1"})) is True
    assert fleet_can_serve(controller([(ReplicaState.SERVING, ("n1",))], liveness=["router stopped"])) is False


def test_health_follows_the_controllers_view(start_gateway):
    gw = start_gateway()
    view = controller([(ReplicaState.SERVING, ("n1",))])
    gw.backend.ready = lambda: fleet_can_serve(view)
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
    view.agents["n1"].lost = True  # its only agent declared lost
    response = httpx.get(f"{gw.url}/health", timeout=10)
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.text
    view.agents["n1"].lost = False
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
