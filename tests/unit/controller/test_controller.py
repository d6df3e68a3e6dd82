"""The controller thread against fake node agents: real ZeroMQ DEALER sockets in this process.

Covers the weight-cache integration: load progress and L2/memory telemetry copied from heartbeats into
status(), load failover on LoadFailed (another node, or stay failed with the reason), L2 prefetch from
demand history, and the engine settings a StartReplica carries; autoscaling: scale-up placement,
scale-down drain-then-stop, the cooldown and the minimum; and the OOM guard: a node short of memory loses
its lowest-priority replica (drained, then stopped), never a model's last, and takes no new one for a while.
"""

from __future__ import annotations

import logging
import time

import pytest
import yaml
import zmq

from exaserve_hpc.cache.manifest import write_manifest
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, GpuInfo, L2EntryStatus, L2Status, LoadFailed, MemoryPoolStatus, Prefetch, ReplicaEvent,
    ReplicaStatus, StartReplica, StopReplica, decode, encode,
)
from exaserve_hpc.controller.autoscale import UP
from exaserve_hpc.controller.loop import Controller
from exaserve_hpc.controller.demand import DemandHistory
from exaserve_hpc.router.port import RouterPortStub

from tests.slurm.fleet import ROOT

MODEL = "tiny-llama"
GiB = 1 << 30


class FakeRouter(RouterPortStub):
    """What the controller uses of a router (router/port.py): endpoints, snapshot() with counters,
    replica_lost(), drain().

    `in_flight` (replica id -> requests) is what the snapshot reports per replica; set it to make load."""
    backend_endpoint = "tcp://127.0.0.1:1"
    frontend_endpoint = "tcp://127.0.0.1:2"

    def __init__(self):
        self.accepted = 0
        self.lost: list[tuple[str, str]] = []
        self.in_flight: dict[str, int] = {}
        self.drained: list[str] = []

    def snapshot(self) -> dict:
        replicas = [{"replica_id": rid, "model": MODEL, "outstanding": n, "queue_depth": 0,
                     "draining": rid in self.drained} for rid, n in sorted(self.in_flight.items())]
        return {"replicas": replicas, "accepted": self.accepted}

    def replica_lost(self, replica_id: str, why: str) -> None:
        self.lost.append((replica_id, why))
        self.in_flight.pop(replica_id, None)

    def drain(self, replica_id: str) -> None:
        self.drained.append(replica_id)


def make_site(tmp_path, replicas: int = 2, scheduler: dict | None = None, model: dict | None = None,
              more_models: list[dict] = ()):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data["scheduler"]["tick_interval"] = 0.05
    data["scheduler"].update(scheduler or {})
    data["models"][0].update(model or {})
    data["heartbeat"] = {"interval": 5.0, "misses": 3}
    data["weight_cache"]["l3_path"] = str(tmp_path / "models")
    data["batching"].update(chunked_prefill=False, prefill_chunk_tokens=128)
    data.setdefault("router", {}).update(coalesce_ms=7.0, coalesce_tokens=5)
    data["models"][0].update(replicas=replicas, enable_prefix_caching=False, kv_cache_dtype="fp8")
    data["models"] += [{**data["models"][0], **extra} for extra in more_models]  # same shape, another name
    model_dir = tmp_path / "models" / MODEL
    model_dir.mkdir(parents=True)
    (model_dir / "weights.bin").write_bytes(b"\0" * 4096)
    write_manifest(model_dir)
    return parse_site(data)


class FakeAgent:
    def __init__(self, context: zmq.Context, endpoint: str, agent_id: str):
        self.agent_id = agent_id
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, agent_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.seq = 0

    def send(self, message) -> None:
        self.socket.send(encode(message))

    def hello(self, free: int = 8 * GiB, l2: L2Status | None = None, host_total: int = 0, gpus: int = 0,
              gpu_memory: int = 80 * GiB) -> None:
        """A CPU node whose pool holds `free` bytes, or a node with `gpus` GPUs of `gpu_memory` each."""
        devices = [GpuInfo(index=i, name="H100", memory_total=gpu_memory) for i in range(gpus)]
        pool = [gpu_memory] * gpus or [free]
        self.send(AgentHello(agent_id=self.agent_id, hostname=self.agent_id, pid=1, host_memory_total=host_total,
                             gpus=devices, memory=MemoryPoolStatus(block_size=1 << 20, total=pool, free=pool),
                             l2=l2 or L2Status(capacity=GiB)))

    def heartbeat(self, replicas=(), free: int = 8 * GiB, l2: L2Status | None = None, host_used: int = 0,
                  reservations: dict[str, int] | None = None) -> None:
        """A CPU node's heartbeat: `host_used` bytes of host memory in use, `reservations` held in its pool."""
        self.seq += 1
        held = reservations or {}
        pool = MemoryPoolStatus(block_size=1 << 20, total=[free + sum(held.values())], free=[free], reservations=held,
                                devices={rid: [0] for rid in held})
        self.send(AgentHeartbeat(agent_id=self.agent_id, seq=self.seq, replicas=list(replicas), memory=pool,
                                 host_memory_used=host_used, l2=l2 or L2Status(capacity=GiB)))

    def expect(self, kind, timeout: float = 10.0, where=lambda m: True):
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            if self.socket.poll(50):
                message = decode(self.socket.recv())
                if isinstance(message, kind) and where(message):
                    return message
                seen.append(message)
        raise AssertionError(f"{self.agent_id}: no {kind.__name__} in {timeout}s; got {seen}")

    def quiet(self, kind, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.socket.poll(50):
                message = decode(self.socket.recv())
                assert not isinstance(message, kind), f"{self.agent_id} got {message}"


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def make_controller(tmp_path, context):
    made = []

    def make(agents=("a",), replicas: int = 2, demand_interval: float = 10.0, scheduler: dict | None = None,
             model: dict | None = None, more_models: list[dict] = ()):
        site = make_site(tmp_path, replicas, scheduler, model, more_models)
        router = FakeRouter()
        controller = Controller(site, router, context=context, expected_agents=list(agents), placement_grace=5.0,
                                demand_interval=demand_interval).start()
        made.append(controller)
        fakes = [FakeAgent(context, controller.endpoint, a) for a in agents]
        sockets.extend(f.socket for f in fakes)
        return controller, router, fakes

    sockets = []
    yield make
    for controller in made:
        controller.stop()
    for socket in sockets:  # a failed test's frames keep them alive, and an open socket blocks ctx.term()
        socket.close(linger=0)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_start_carries_engine_settings_and_heartbeat_load_progress_reaches_status(make_controller):
    controller, _, (agent,) = make_controller(replicas=1, model={"tensor_parallel": 2, "gpu_memory_utilization": 0.5})
    l2 = L2Status(capacity=GiB, used=4096, entries=[L2EntryStatus(model=MODEL, nbytes=4096, state="filling")])
    agent.hello(l2=l2, gpus=4)
    start = agent.expect(StartReplica)
    assert start.replica_id == f"{MODEL}/r0000"
    s = start.settings
    assert (s.enable_prefix_caching, s.kv_cache_dtype, s.chunked_prefill, s.prefill_chunk_tokens) == \
        (False, "fp8", False, 128)
    assert (start.coalesce_ms, start.coalesce_tokens) == (7.0, 5)  # router.coalesce_* reach the replica
    assert start.devices == 2  # the model's tensor_parallel: devices reserved on one node ...
    assert start.gpu_indices == [0, 1]  # ... the ones the plan chose (one NVLink domain) ...
    assert start.memory_bytes == 40 * GiB  # ... and what the plan reserved: gpu_memory_utilization x 80 GiB

    agent.heartbeat([ReplicaStatus(replica_id=start.replica_id, model=MODEL, state="loading", pid=0,
                                   load_progress=0.25, load_bytes_done=1024, load_bytes_total=4096,
                                   load_source="l3")], free=3 * GiB, l2=l2)

    def loaded():
        replica = controller.status()["replicas"][0]
        return replica if replica["load_bytes_done"] == 1024 else None
    replica = wait_for(loaded, what="load progress in status()")
    assert (replica["load_progress"], replica["load_bytes_total"], replica["load_source"]) == (0.25, 4096, "l3")
    record = controller.agents["a"]
    assert record.memory.free == [3 * GiB] and record.l2 == l2
    assert controller.status()["agents"][0]["l2"] == {"capacity": GiB, "used": 4096, "models": {MODEL: "filling"}}


def test_load_failure_moves_the_replica_to_the_node_holding_it_in_l2_then_gives_up(make_controller):
    controller, _, (a, b, c) = make_controller(agents=("a", "b", "c"), replicas=3)
    ready = L2Status(capacity=GiB, used=4096, entries=[L2EntryStatus(model=MODEL, nbytes=4096, state="ready")])
    a.hello()
    b.hello(free=2 * GiB, l2=ready)  # less free memory than c, but the weights are already in its L2
    c.hello(free=6 * GiB)
    start = a.expect(StartReplica)
    for agent in (b, c):
        agent.expect(StartReplica)
    rid = start.replica_id
    a.send(ReplicaEvent(agent_id="a", replica_id=rid, state="failed", detail="load timed out 4 times"))
    a.send(LoadFailed(agent_id="a", replica_id=rid, model=MODEL, reason="load_timeout", attempts=4))
    moved = b.expect(StartReplica, where=lambda m: m.replica_id == rid)
    assert moved.model == MODEL
    wait_for(lambda: controller.replicas[rid].agent_id == "b", what="replica reassigned to b")

    # b fails too; c is the last node not tried.
    b.send(LoadFailed(agent_id="b", replica_id=rid, model=MODEL, reason="io", detail="EIO"))
    c.expect(StartReplica, where=lambda m: m.replica_id == rid)
    # c fails with a bad checksum: the shared store's copy is bad, no node is tried again.
    c.send(LoadFailed(agent_id="c", replica_id=rid, model=MODEL, reason="checksum"))
    record = wait_for(lambda: next((r for r in controller.status()["replicas"]
                                    if r["replica_id"] == rid and r["state"] == "failed"), None),
                      what="replica left failed")
    assert "repair it first" in record["detail"] and record["node"] == "c"
    for agent in (a, b, c):
        agent.quiet(StartReplica, 0.5)  # and no same-node restart either


def test_prefetch_follows_rising_demand_once_per_model(make_controller):
    controller, router, (agent,) = make_controller(replicas=0, demand_interval=0.1)
    agent.hello()
    for _ in range(3):
        router.accepted += 50
        time.sleep(0.12)
    prefetch = agent.expect(Prefetch)
    assert prefetch.model == MODEL and prefetch.model_dir.endswith(f"models/{MODEL}")
    agent.quiet(Prefetch, 0.5)  # not again before a heartbeat shows it filling


def test_demand_history_splits_the_total_by_outstanding_requests():
    demand = DemandHistory(["m1", "m2"])
    demand.observe({"accepted": 10, "replicas": []})
    demand.observe({"accepted": 40, "replicas": [{"model": "m1", "outstanding": 2}, {"model": "m2", "outstanding": 1}]})
    demand.observe({"accepted": 40, "accepted_by_model": {"m1": 5, "m2": 7}})
    demand.observe({"accepted": 40, "accepted_by_model": {"m1": 9, "m2": 7}})
    assert demand.history() == {"m1": [20.0, 4.0], "m2": [10.0, 0.0]}


def test_a_preferred_placement_is_honoured_where_it_has_room(tmp_path):
    from exaserve_hpc.controller.catalogue import catalogue_from_site
    from exaserve_hpc.controller.live_placement import fleet_topology, place_pending
    site = make_site(tmp_path, 4, scheduler={"max_replicas_per_node": 2})
    inventory = [{"hostname": h, "host_memory": 8 * GiB} for h in ("a", "b")]
    pending = [(f"{MODEL}/r{i:04d}", MODEL) for i in range(4)]
    preferred = {f"{MODEL}/r0000": "b", f"{MODEL}/r0001": "b", f"{MODEL}/r0002": "gone", f"{MODEL}/r0003": "b"}
    result = place_pending(fleet_topology(site, inventory), catalogue_from_site(site), 2, [], pending,
                           preferred=preferred)
    assert {rid: a.node for rid, a in result.placed.items()} == {
        f"{MODEL}/r0000": "b", f"{MODEL}/r0001": "b", f"{MODEL}/r0002": "a", f"{MODEL}/r0003": "a"}
    # a closed node keeps what it holds and takes nothing; the reason says so
    held = [result.placed[f"{MODEL}/r0000"]]
    again = place_pending(fleet_topology(site, inventory), catalogue_from_site(site), 2, held,
                          pending[1:], closed={"a": "short of device memory", "b": "short of device memory"})
    assert not again.placed and all("closed to new replicas: a (short of device memory)" in why
                                    for why in again.unplaced.values())


def test_restored_placement_sends_replicas_back_to_their_nodes(make_controller):
    from exaserve_hpc.controller_state import ControllerState
    controller, _, (a, b) = make_controller(agents=("a", "b"), replicas=2)
    controller.stop()  # a fresh one, restored before it starts
    site, router = controller.site, controller.router
    state = ControllerState("9", 0, 5.0, placement={f"{MODEL}/r0000": (MODEL, "b"), f"{MODEL}/r0001": (MODEL, "b")},
                            excluded_nodes=["c"])
    fresh = Controller(site, router, context=a.socket.context, expected_agents=["a", "b"], placement_grace=5.0)
    fresh.restore(state)
    fresh.start()
    try:
        for agent in (a, b):
            agent.socket.disconnect(controller.endpoint)
            agent.socket.connect(fresh.endpoint)
            agent.hello()
        starts = {b.expect(StartReplica).replica_id, b.expect(StartReplica).replica_id}
        assert starts == {f"{MODEL}/r0000", f"{MODEL}/r0001"}
        a.quiet(StartReplica, 0.3)
        assert fresh.status()["restored"]["excluded_nodes"] == ["c"]
    finally:
        fresh.stop()


# ---------------------------------------------------------------- autoscaling


def serve_all(agent: FakeAgent, count: int) -> list[str]:
    """Take `count` StartReplica messages and report each replica serving; returns their ids."""
    rids = [agent.expect(StartReplica).replica_id for _ in range(count)]
    for rid in rids:
        agent.send(ReplicaEvent(agent_id=agent.agent_id, replica_id=rid, state="serving"))
    return rids


def model_status(controller: Controller) -> dict:
    (model,) = controller.status()["models"]
    return model


def test_scale_up_places_fresh_replicas_where_there_is_room_and_the_target_is_cut_to_it(make_controller):
    controller, router, (a, b) = make_controller(
        agents=("a", "b"), replicas=1, scheduler={"max_replicas_per_node": 1, "scale_up_threshold": 0.5},
        model={"min_replicas": 1, "max_batch_size": 2})
    a.hello()
    wait_for(lambda: "a" in controller.agents, what="a's hello")  # so a is listed first
    b.hello()
    (first,) = serve_all(a, 1)  # the first agent in the list gets it (ties go to the first)
    assert first == f"{MODEL}/r0000"
    b.quiet(StartReplica, 0.3)  # 1 replica, no load: nothing to add
    router.in_flight[first] = 3  # load 3 / (1 x 2) = 1.5 > 0.5: 3 / (2 x 0.375) -> 4 replicas

    started = b.expect(StartReplica)
    assert started.replica_id == f"{MODEL}/r0001"
    # The autoscaler asked for 4; two nodes of one replica each hold 2: the target is cut to what fits.
    status = wait_for(lambda: (m := model_status(controller))["bounded"] and m, what="a bounded target")
    assert status["target"] == 2 and status["current"] == 1
    assert status["last_scale"]["from"] == 1 and status["last_scale"]["to"] == 4
    assert "load 1.50 > scale_up_threshold 0.5" in status["last_scale"]["reason"]
    assert status["bounded"].startswith("target 4 cut to 2: room for 1 more")
    assert "max_replicas_per_node (1)" in status["bounded"]
    a.quiet(StartReplica, 0.3)  # a is full; nothing waits for room, no further ids are issued
    assert len(controller.replicas) == 2


def test_scale_down_drains_the_least_busy_in_the_router_before_stopping_them(make_controller):
    controller, router, (agent,) = make_controller(replicas=3, scheduler={"cooldown_period": 0},
                                                   model={"min_replicas": 1, "max_batch_size": 16})
    router.in_flight.update({f"{MODEL}/r0000": 1, f"{MODEL}/r0001": 0, f"{MODEL}/r0002": 2})
    agent.hello()
    serve_all(agent, 3)  # load 3 / 48 < 0.25: 3 -> 1 replica; the one with 2 in flight stays

    stopped = [agent.expect(StopReplica), agent.expect(StopReplica)]
    assert [s.replica_id for s in stopped] == [f"{MODEL}/r0001", f"{MODEL}/r0000"]
    assert router.drained == [f"{MODEL}/r0001", f"{MODEL}/r0000"]  # drained before the stop was sent
    assert all(s.drain_timeout == 30.0 for s in stopped)
    status = model_status(controller)
    assert (status["current"], status["target"], status["stopping"]) == (1, 1, 2)
    assert "scale_down_threshold" in status["last_scale"]["reason"]

    # A draining replica finishes what it holds: its record stays until the agent says it stopped.
    agent.send(ReplicaEvent(agent_id="a", replica_id=f"{MODEL}/r0001", state="draining"))
    agent.send(ReplicaEvent(agent_id="a", replica_id=f"{MODEL}/r0001", state="stopped", detail="stopped on request"))
    wait_for(lambda: f"{MODEL}/r0001" not in controller.replicas, what="stopped replica forgotten")
    assert f"{MODEL}/r0000" in controller.replicas and controller.replicas[f"{MODEL}/r0000"].stopping
    # the router is told after the record goes (another step of the controller's thread): wait on it too
    wait_for(lambda: (f"{MODEL}/r0001", "scaled down, stopped") in router.lost, what="the router told")
    agent.quiet(StartReplica, 0.3)  # a scaled-down replica is not restarted


def test_a_scale_down_waits_for_the_cooldown_a_scale_up_does_not_and_takes_a_fresh_id(make_controller):
    controller, router, (agent,) = make_controller(
        replicas=2, scheduler={"cooldown_period": 1.5, "scale_up_threshold": 0.5},
        model={"min_replicas": 1, "max_batch_size": 2})
    agent.hello()
    # Nothing serves until serve_all reports it, so a tick sees 0 < min_replicas and scales up; wait for
    # that tick (under load it can come after the StartReplica messages, which placement sends).
    wait_for(lambda: MODEL in controller.last_scaling, what="the start-up's scale-up")
    first, second = serve_all(agent, 2)
    (startup, up_at) = controller.last_scaling[MODEL]  # the start-up's scale-up (wall time)
    assert startup.direction == UP
    stop = agent.expect(StopReplica)  # idle: 2 -> 1, once the start-up's scale-up is 1.5 s old
    assert stop.replica_id == second and time.time() - up_at >= 1.4
    agent.send(ReplicaEvent(agent_id="a", replica_id=second, state="stopped"))
    router.in_flight[first] = 2  # load 1.0 > 0.5: a scale-up never waits for the cooldown (it is queueing)
    start = agent.expect(StartReplica)
    assert start.replica_id == f"{MODEL}/r0002"  # r0001 is never reused
    (up, _) = controller.last_scaling[MODEL]
    assert up.direction == UP and up.reason.startswith("load 1.00 > scale_up_threshold 0.5"), up.reason


def test_scale_down_never_goes_below_the_model_minimum(make_controller):
    controller, router, (agent,) = make_controller(replicas=3, scheduler={"cooldown_period": 0},
                                                   model={"min_replicas": 2})
    agent.hello()
    rids = serve_all(agent, 3)
    stop = agent.expect(StopReplica)
    assert stop.replica_id == rids[-1]  # all idle: the newest goes
    agent.send(ReplicaEvent(agent_id="a", replica_id=stop.replica_id, state="stopped"))
    wait_for(lambda: len(controller.replicas) == 2, what="scaled down to 2")
    agent.quiet(StopReplica, 0.5)
    status = model_status(controller)
    assert (status["current"], status["target"], status["min_replicas"]) == (2, 2, 2)
    assert status["decision"] == "hold: load 0.00 < scale_down_threshold 0.25 but at min_replicas 2"


def test_model_loads_count_serving_replicas_and_what_is_in_flight_on_them(tmp_path):
    from exaserve_hpc.agent.lifecycle import ReplicaState
    from exaserve_hpc.controller.fleet_state import ReplicaRecord, model_loads, pick_for_removal

    site = make_site(tmp_path, 4, model={"max_batch_size": 8})
    records = [ReplicaRecord(f"{MODEL}/r000{i}", MODEL, agent_id="a", state=ReplicaState.SERVING) for i in range(4)]
    records[2].state = ReplicaState.LOADING
    records[3].stopping = True
    routed = {r.replica_id: {"outstanding": 3, "queue_depth": 5 if i == 1 else 0} for i, r in enumerate(records)}
    (load,) = model_loads(site, records, routed)
    assert (load.replicas, load.queue_depth, load.capacity_per_replica, load.starting) == (2, 8, 8, 1)
    routed[records[0].replica_id]["draining"] = True  # drained in the router: no longer serving
    assert model_loads(site, records, routed)[0].replicas == 1
    assert pick_for_removal(records, routed, 2) == [f"{MODEL}/r0002", f"{MODEL}/r0000"]


def test_requests_waiting_in_the_router_are_demand_even_with_no_replica(tmp_path):
    from exaserve_hpc.controller.autoscale import AutoscalePolicy, ScalingHistory, decide
    from exaserve_hpc.controller.fleet_state import model_loads

    site = make_site(tmp_path, 0, model={"max_batch_size": 8, "min_replicas": 0})
    (idle,) = model_loads(site, [], {})
    (waiting,) = model_loads(site, [], {}, {MODEL: 3, "another-model": 5})
    assert (idle.replicas, idle.queue_depth, waiting.queue_depth) == (0, 0, 3)
    policy = AutoscalePolicy.from_site(site)
    assert decide(idle, policy, ScalingHistory(), 0.0).target == 0
    assert decide(waiting, policy, ScalingHistory(), 0.0).target == 1


# ---------------------------------------------------------------- OOM guard

HIGH = "big-llama"  # a second model of the same size, kept longer (priority 90 against tiny-llama's 0)


def oom_controller(make_controller, replicas: int, minimum: int, cooldown: float = 120.0):
    """One CPU node with 8 GiB of host memory; tiny-llama (priority 0) and big-llama (priority 90), each with
    `replicas` replicas serving, 1 GiB reserved each. The guard checks every tick, not every 5 s heartbeat."""
    controller, router, (agent,) = make_controller(
        replicas=replicas, scheduler={"cooldown_period": cooldown}, model={"priority": 0, "min_replicas": minimum},
        more_models=[{"model_name": HIGH, "replicas": replicas, "priority": 90, "min_replicas": minimum}])
    controller.oom.interval = 0.05
    agent.hello(host_total=8 * GiB)
    rids = serve_all(agent, 2 * replicas)
    return controller, router, agent, {rid: GiB for rid in rids}


def test_oom_guard_drains_and_stops_the_lowest_priority_replica_and_its_node_takes_no_new_one(make_controller):
    controller, router, agent, held = oom_controller(make_controller, replicas=2, minimum=2, cooldown=3.0)
    agent.heartbeat(host_used=4 * GiB, reservations=held)  # half full: nothing to do
    agent.quiet(StopReplica, 0.5)
    assert controller.status()["oom"] == {"evictions": [], "unresolved": []} and router.drained == []

    agent.heartbeat(host_used=int(7.9 * GiB), reservations=held)  # over 95 % in use: short by ~0.3 GiB
    stop = agent.expect(StopReplica)
    evicted = f"{MODEL}/r0001"  # lowest priority, newest of its model
    assert stop.replica_id == evicted and router.drained == [evicted]  # out of routing, then stopped
    (eviction,) = controller.status()["oom"]["evictions"]
    assert (eviction["replica_id"], eviction["model"], eviction["node"], eviction["device"]) == (evicted, MODEL, "a", 0)
    assert "a/0 short by" in eviction["reason"]
    status = controller.status()
    detail = {r["replica_id"]: r["detail"] for r in status["replicas"]}
    assert detail[evicted].startswith("evicted by the OOM guard: a/0 short by")
    assert status["agents"][0]["memory_closed"]

    # Below its minimum, tiny-llama gets a fresh replica at once; the short node does not take it.
    waiting = wait_for(lambda: next((r for r in controller.status()["replicas"]
                                     if r["replica_id"] == f"{MODEL}/r0002" and r["node"] is None), None),
                       what="a replacement waiting")
    assert "short of device memory" in waiting["detail"]
    # Still 7.9 GiB in use, but 1 GiB of it is the evicted replica on its way out: no second eviction.
    agent.heartbeat(host_used=int(7.9 * GiB), reservations=held)
    agent.quiet((StopReplica, StartReplica), 0.5)
    assert all(not controller.replicas[f"{HIGH}/r{i:04d}"].stopping for i in range(2))

    agent.send(ReplicaEvent(agent_id="a", replica_id=evicted, state="stopped"))
    del held[evicted]
    agent.heartbeat(host_used=3 * GiB, reservations=held)  # memory back to normal
    start = agent.expect(StartReplica, timeout=6.0)  # once the node's hold (cooldown_period) is over
    assert start.replica_id == f"{MODEL}/r0002"
    assert not controller.status()["agents"][0]["memory_closed"]
    assert len(controller.status()["oom"]["evictions"]) == 1  # kept after the record went


def test_oom_guard_never_evicts_the_last_replica_of_a_model_and_warns_once(make_controller, caplog):
    caplog.set_level(logging.WARNING, logger="exaserve.oom")
    controller, router, agent, held = oom_controller(make_controller, replicas=1, minimum=1)
    for _ in range(4):
        agent.heartbeat(host_used=8 * GiB, reservations=held)  # full, and each model has one replica
        time.sleep(0.15)
    agent.quiet(StopReplica, 0.3)
    assert router.drained == [] and controller.status()["oom"]["evictions"] == []
    (line,) = controller.status()["oom"]["unresolved"]
    assert line.startswith("a/0 still short by") and f"last of {HIGH}, {MODEL}" in line
    assert [r.getMessage() for r in caplog.records if "still short" in r.getMessage()] == [f"OOM guard: {line}"]
