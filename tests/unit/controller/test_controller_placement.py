"""The running controller places with the planner: driven through its message handler (no sockets).

A Controller gets one AgentHello per node (the site's nodes, their GPUs as NVML would report them) and
ticks; what it sends (StartReplica per replica) must be the placement `exaserve plan` computes for the same
site, and a node loss must re-place as failover.py does. Then what the controller adds on top of the pure
policies: a refused reservation goes elsewhere, a replica past its restart limit leaves its node (marked
suspect), a rebalance round moves at most max_moves_per_round replicas with the KV snapshot paths set.
"""

from __future__ import annotations

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import AgentHello, GpuInfo, MemoryPoolStatus, ReplicaEvent, StartReplica, StopReplica
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.core import MAX_RESTARTS, ControllerCore
from exaserve_hpc.controller.failover import failover
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.placement import plan_site
from exaserve_hpc.topology import topology_from_site

GiB = 1 << 30


class StubRouter(RouterPortStub):
    """What the controller reads of the router: endpoints, snapshot(), replica_lost(), drain()."""
    backend_endpoint = "tcp://127.0.0.1:1"
    frontend_endpoint = "tcp://127.0.0.1:2"

    def __init__(self):
        self.drained: list[str] = []

    def snapshot(self) -> dict:
        return {"replicas": []}

    def replica_lost(self, replica_id: str, why: str) -> None:
        pass

    def drain(self, replica_id: str) -> None:
        self.drained.append(replica_id)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gpu_site(tmp_path, scheduler: dict | None = None, models: list[dict] | None = None):
    """Two fault groups of two nodes, 4 GPUs of 80 GiB each (declared), TP=2, PP=2 and fractional models."""
    return parse_site({
        "site": "fg2x2", "run_dir": str(tmp_path / "run"),
        "cluster": {"nodes": 4, "nodelist": "n[1-4]", "gpus_per_node": 4, "gpu_memory": "80GiB",
                    "fault_groups": {"rack0": "n[1-2]", "rack1": "n[3-4]"}},
        "scheduler": {"max_replicas_per_node": 8, "cooldown_period": 3600, **(scheduler or {})},
        "weight_cache": {"l3_path": str(tmp_path / "models")},
        "models": models or [
            {"model_name": "tp2", "engine": "echo", "replicas": 3, "min_replicas": 3, "tensor_parallel": 2,
             "gpu_memory_utilization": 0.9},
            {"model_name": "pp2", "engine": "echo", "replicas": 1, "min_replicas": 1, "pipeline_parallel": 2,
             "gpu_memory_utilization": 0.9},
            {"model_name": "frac", "engine": "echo", "replicas": 6, "min_replicas": 6,
             "gpu_memory_utilization": 0.3},
        ]})


def hello(site, node: str) -> AgentHello:
    gpus = [GpuInfo(index=i, name="A100", memory_total=site.cluster.gpu_memory) for i in range(site.cluster.gpus_per_node)]
    pool = [site.cluster.gpu_memory] * len(gpus)
    return AgentHello(agent_id=node, hostname=node, pid=1, gpus=gpus, host_memory_total=512 * GiB,
                      memory=MemoryPoolStatus(block_size=GiB, total=pool, free=pool))


def controller_with_agents(site, nodes=None):
    clock = Clock()
    nodes = nodes or site.cluster.hostnames()
    ctl = ControllerCore(site, StubRouter(), clock=clock, expected_agents=nodes)
    for node in reversed(nodes):  # hello order must not matter: the site's host order does
        ctl.handle(node, hello(site, node))
    return ctl, clock


def starts(ctl) -> dict[str, tuple[str, StartReplica]]:
    """replica id -> (node, StartReplica) of each replica started (stage 0's, for a pipeline-parallel one)."""
    return {m.replica_id: (node, m) for node, m in ctl.fleet.take_outbox()
            if isinstance(m, StartReplica) and getattr(getattr(m, "stage", None), "rank", 0) == 0}


def serve_all(ctl, sent) -> None:
    for rid, (node, _) in sent.items():
        ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="serving"))


def test_the_running_controller_places_as_exaserve_plan_does(tmp_path):
    site = gpu_site(tmp_path)
    plan = plan_site(site)
    assert not plan.unplaced
    ctl, _ = controller_with_agents(site)
    sent = starts(ctl)
    assert {rid: (node, tuple(m.gpu_indices)) for rid, (node, m) in sent.items()} == \
        {a.replica_id: (a.node, a.gpus) for a in plan.assignments}
    for a in plan.assignments:  # the exact devices and the bytes the plan reserved on each
        node, spec = sent[a.replica_id]
        assert spec.memory_bytes == a.bytes_per_gpu and spec.devices == len(a.gpus)
    assert {rid: r.assignment for rid, r in ctl.replicas.items()} == plan.by_id()
    (pp,) = [r for r in ctl.replicas.values() if r.model == "pp2"]
    assert len(set(pp.assignment.nodes)) == 2  # stages on distinct nodes of one group
    assert len(ctl.fleet.stage_specs(pp)) == 2 and ctl.status()["placement"]["violations"] == []
    snapshot = ctl.snapshot()  # the typed view other components read instead of status()'s JSON
    assert snapshot.live_nodes() == ("n1", "n2", "n3", "n4") and snapshot.lost_nodes() == ()
    assert snapshot.placement() == {a.replica_id: (a.model, a.node) for a in plan.assignments}
    assert {r.replica_id: r.gpus for r in snapshot.on_node("n1")} == \
        {a.replica_id: a.gpus for a in plan.assignments if "n1" in a.nodes}


def test_a_lost_node_is_re_placed_as_failover_computes_and_the_spread_holds(tmp_path):
    site = gpu_site(tmp_path)
    ctl, clock = controller_with_agents(site)
    serve_all(ctl, starts(ctl))
    plan, topo, cat = ctl.fleet.plan(), topology_from_site(site), catalogue_from_site(site)
    expected = failover(plan, topo, cat, ["n1"], site.scheduler.max_replicas_per_node)
    clock.now += site.heartbeat.expiry + site.heartbeat.loss_grace + 1  # suspected, then lost
    for node in ("n2", "n3", "n4"):
        ctl.agents[node].last_seen = clock.now
    ctl.tick(clock.now)
    sent = starts(ctl)
    moved = {r.replica_id: r.new for r in expected.replacements if r.new is not None}
    assert moved and {rid: (node, tuple(m.gpu_indices)) for rid, (node, m) in sent.items()} == \
        {rid: (a.node, a.gpus) for rid, a in moved.items()}
    after = ctl.fleet.plan()
    assert plan_violations(after, topo, cat, site.scheduler.max_replicas_per_node) == []
    assert all("n1" not in a.nodes for a in after.assignments)


def test_a_refused_reservation_is_placed_on_another_node(tmp_path):
    site = gpu_site(tmp_path, models=[{"model_name": "m", "engine": "echo", "replicas": 1, "min_replicas": 1,
                                       "gpu_memory_utilization": 0.5}])
    ctl, _ = controller_with_agents(site)
    ((rid, (node, _)),) = starts(ctl).items()
    ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="failed",
                                  detail="reserve failed: 40.0 GiB per device on 1 device(s), 10.0 GiB free"))
    ((again, (other, spec)),) = starts(ctl).items()
    assert again == rid and other != node and spec.memory_bytes == 40 * GiB
    assert ctl.replicas[rid].tried_agents == {node}


def test_a_replica_past_its_restart_limit_leaves_its_node_which_is_marked_suspect(tmp_path):
    site = gpu_site(tmp_path, models=[{"model_name": "m", "engine": "echo", "replicas": 1, "min_replicas": 1,
                                       "gpu_memory_utilization": 0.5}])
    ctl, clock = controller_with_agents(site)
    ((rid, (node, _)),) = starts(ctl).items()
    for attempt in range(MAX_RESTARTS):
        ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="failed", detail="exit 1"))
        clock.now += 60
        for a in ctl.agents.values():
            a.last_seen = clock.now
        ctl.tick(clock.now)
        ((_, (where, _)),) = starts(ctl).items()
        assert where == node  # restarted in place, with backoff
    ctl.handle(node, ReplicaEvent(agent_id=node, replica_id=rid, state="failed", detail="exit 1"))
    ((_, (where, _)),) = starts(ctl).items()
    assert where != node
    status = ctl.status()
    assert status["agents"][[a["agent_id"] for a in status["agents"]].index(node)]["suspect"] == \
        f"{rid} failed {MAX_RESTARTS + 1} times here: exit 1"
    (model,) = status["models"]
    assert model["below_min"].startswith(f"{rid} pending on {where}")  # below its minimum, and why


def test_a_model_below_its_minimum_says_why_when_it_fits_nowhere(tmp_path):
    site = gpu_site(tmp_path, models=[{"model_name": "huge", "engine": "echo", "replicas": 1, "min_replicas": 1,
                                       "tensor_parallel": 8, "gpu_memory_utilization": 0.9}])
    ctl, _ = controller_with_agents(site)
    assert not starts(ctl)
    (model,) = ctl.status()["models"]
    assert "tensor_parallel 8 needs 8 devices in one NVLink domain" in model["below_min"]


@pytest.mark.parametrize("others_serving", [True, False])
def test_a_rebalance_round_moves_at_most_max_moves_per_round_keeping_the_cache_or_the_count(tmp_path,
                                                                                             others_serving):
    """Everything lands on the only node at first; once a second node joins, a round moves replicas there:
    at most max_moves_per_round, each with KV snapshot paths (drain first, new starts from the snapshot) when
    the model has other replicas serving, or start-new-then-drain-old when it has none."""
    models = [{"model_name": "m", "engine": "reference", "replicas": 4 if others_serving else 1,
               "min_replicas": 4 if others_serving else 1, "max_seq_len": 256,
               "tiny": {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64, "max_position": 256}}]
    if not others_serving:  # m's only replica moves (a weightless model fills the node beside it)
        models.append({"model_name": "n", "engine": "echo", "replicas": 3, "min_replicas": 3})
    site = parse_site({"site": "cpu2", "run_dir": str(tmp_path / "run"),
                       "cluster": {"nodes": 2, "nodelist": "a,b", "host_memory": "8GiB"},
                       "scheduler": {"max_replicas_per_node": 4, "rebalance_interval": 30, "max_moves_per_round": 1,
                                     "cooldown_period": 3600},
                       "weight_cache": {"l3_path": str(tmp_path / "models")}, "models": models})
    clock = Clock()
    ctl = ControllerCore(site, StubRouter(), clock=clock)
    pool = MemoryPoolStatus(block_size=GiB, total=[8 * GiB], free=[8 * GiB])
    ctl.handle("a", AgentHello(agent_id="a", hostname="a", pid=1, host_memory_total=8 * GiB, memory=pool))
    first = starts(ctl)
    assert {node for node, _ in first.values()} == {"a"}
    assert all(m.kv_snapshot_out.endswith(f"{rid.replace('/', '.')}.h5") == (m.model == "m")
               for rid, (_, m) in first.items())  # every replica of a snapshot engine writes one as it drains
    serve_all(ctl, first)
    ctl.handle("b", AgentHello(agent_id="b", hostname="b", pid=1, host_memory_total=8 * GiB, memory=pool))
    for _ in range(3):  # three rounds, rebalance_interval apart
        clock.now += 31
        for agent in ctl.agents.values():
            agent.last_seen = clock.now
        ctl.tick(clock.now)
        out = ctl.fleet.take_outbox()
        new = [(n, m) for n, m in out if isinstance(m, StartReplica)]
        stops = [(n, m) for n, m in out if isinstance(m, StopReplica)]
        assert len(new) + len(stops) <= 1  # one move per round (max_moves_per_round 1), one step at a time
        if others_serving:
            (node, stop), = stops
            assert node == "a" and not new and ctl.router.drained[-1] == stop.replica_id
            moved = next(r for r in ctl.replicas.values() if r.kv_snapshot_in)
            assert moved.kv_snapshot_in == ctl.fleet.kv_snapshot_path(stop.replica_id) and moved.agent_id is None
            ctl.handle("a", ReplicaEvent(agent_id="a", replica_id=stop.replica_id, state="stopped"))
            clock.now += 1
            ctl.tick(clock.now)
            (node, spec), = [(n, m) for n, m in ctl.fleet.take_outbox() if isinstance(m, StartReplica)]
            assert node == "b" and spec.kv_snapshot_in == moved.kv_snapshot_in  # starts from the old one's cache
            ctl.handle("b", ReplicaEvent(agent_id="b", replica_id=spec.replica_id, state="serving"))
            ctl.tick(clock.now)
            break
        if new:
            (node, spec), = new
            assert node == "b" and not spec.kv_snapshot_in  # the only replica: capacity first, cold cache
            ctl.handle("b", ReplicaEvent(agent_id="b", replica_id=spec.replica_id, state="serving"))
            ctl.tick(clock.now)
            (stop,) = [m for n, m in ctl.fleet.take_outbox() if isinstance(m, StopReplica)]
            assert stop.replica_id == "m/r0000"  # drained only once the new one serves
            break
    else:
        pytest.fail("no rebalance move in three rounds")
    rounds = ctl.status()["placement"]["rebalance_rounds"]
    assert len(rounds) == 1 and len(rounds[0]["moves"]) == 1
    assert rounds[0]["moves"][0]["order"] == ("drain-first" if others_serving else "start-first")


def test_a_replica_its_node_stops_unasked_moves_with_its_kv_snapshot_and_the_node_takes_no_new_one(tmp_path):
    """A graceful leave (the node's agent drains its replicas, e.g. on SIGTERM) is a planned move."""
    site = parse_site({"site": "cpu2", "run_dir": str(tmp_path / "run"),
                       "cluster": {"nodes": 2, "nodelist": "a,b", "host_memory": "8GiB"},
                       "scheduler": {"max_replicas_per_node": 4, "cooldown_period": 3600},
                       "weight_cache": {"l3_path": str(tmp_path / "models")},
                       "models": [{"model_name": "m", "engine": "reference", "replicas": 2, "min_replicas": 2,
                                   "max_seq_len": 256, "tiny": {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                                "intermediate": 64, "max_position": 256}}]})
    ctl, clock = controller_with_agents(site)
    sent = starts(ctl)
    assert sorted(node for node, _ in sent.values()) == ["a", "b"]  # one per fault group
    serve_all(ctl, sent)
    (rid, (node, spec)), = [(r, s) for r, s in sent.items() if s[0] == "a"]
    ctl.handle("a", ReplicaEvent(agent_id="a", replica_id=rid, state="stopped", detail="agent shutting down"))
    (again, (where, moved)), = starts(ctl).items()
    assert (again, where) == (rid, "b") and moved.kv_snapshot_in == spec.kv_snapshot_out != ""
    status = ctl.status()
    assert next(a for a in status["agents"] if a["agent_id"] == "a")["leaving"].startswith(f"stopped {rid} unasked")
    ctl.fleet.add("m", 1, "more")
    ctl.tick(clock.now)
    (_, (where, _)), = starts(ctl).items()
    assert where == "b"  # the leaving node takes no new replica
    # when the controller itself shuts the fleet down, stopped replicas stay stopped
    ctl.shut_down_fleet(drain_timeout=10.0)
    ctl.handle("b", ReplicaEvent(agent_id="b", replica_id=rid, state="stopped", detail="shutdown"))
    assert not starts(ctl)


def test_nvlink_domains_come_from_nvml_where_the_agents_report_them(tmp_path):
    """Two domains of 2 GPUs per node reported by NVML (the site says one domain of 4): a TP=2 replica stays
    inside one of them, and a TP=4 one fits nowhere, with the planner's reason in status."""
    site = gpu_site(tmp_path, models=[
        {"model_name": "tp2", "engine": "echo", "replicas": 1, "min_replicas": 1, "tensor_parallel": 2},
        {"model_name": "tp4", "engine": "echo", "replicas": 1, "min_replicas": 1, "tensor_parallel": 4}])
    clock = Clock()
    ctl = ControllerCore(site, StubRouter(), clock=clock)
    greeting = hello(site, "n1")
    for gpu in greeting.gpus:
        gpu.nvlink_domain = gpu.index // 2
    ctl.handle("n1", greeting)
    ((rid, (node, spec)),) = starts(ctl).items()
    assert rid == "tp2/r0000" and spec.gpu_indices in ([0, 1], [2, 3])
    tp4 = next(m for m in ctl.status()["models"] if m["model"] == "tp4")
    assert "largest NVLink domain has 2 GPUs" in tp4["below_min"]


def test_granted_gpus_nvml_cannot_see_are_planned_as_gpus_of_their_pool_share(tmp_path):
    """Slurm GRES stand-ins (slurm-local): no NVML reading, but the pool names 4 granted devices: the plan
    uses 4 GPUs per node, each as big as its pool share, so replicas spread over them as `exaserve plan`
    spreads them over the declared GPUs."""
    site = parse_site({"site": "standin", "run_dir": str(tmp_path / "run"),
                       "cluster": {"nodes": 2, "nodelist": "n[1-2]", "gpus_per_node": 4, "gpu_memory": "1GiB",
                                   "fault_groups": {"ra": "n1", "rb": "n2"}},
                       "scheduler": {"max_replicas_per_node": 4},
                       "weight_cache": {"l3_path": str(tmp_path / "models")},
                       "models": [{"model_name": "m", "engine": "echo", "replicas": 4, "min_replicas": 4,
                                   "gpu_memory_utilization": 0.6}]})
    clock = Clock()
    ctl = ControllerCore(site, StubRouter(), clock=clock, expected_agents=["n1", "n2"])
    share = 700 << 20  # (host memory x 0.9 - L2) / 4
    for node in ("n1", "n2"):
        ctl.handle(node, AgentHello(agent_id=node, hostname=node, pid=1, host_memory_total=4 * GiB,
                                    memory=MemoryPoolStatus(block_size=1 << 20, total=[share] * 4, free=[share] * 4,
                                                            device_ids=[f"{i}" for i in range(4)])))
    sent = starts(ctl)
    plan = plan_site(site)
    assert {rid: (node, tuple(m.gpu_indices)) for rid, (node, m) in sent.items()} == \
        {a.replica_id: (a.node, a.gpus) for a in plan.assignments}
    assert {m.memory_bytes for _, m in sent.values()} == {int(0.6 * share)}  # what the pool can grant
