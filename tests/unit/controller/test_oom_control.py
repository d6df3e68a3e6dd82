"""The OOM guard's inputs built from what the controller stores: readings, the plan, request rates."""

from __future__ import annotations

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.agent.memory_pool import MemoryPool
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello, GpuInfo, MemoryPoolStatus
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.fleet_state import AgentRecord, ReplicaRecord
from exaserve_hpc.controller.live_placement import fleet_topology, place_pending
from exaserve_hpc.controller.demand import DemandHistory
from exaserve_hpc.controller.oom_control import (
    OomControl, agent_readings, fleet_plan, is_short, request_rates, reservation_devices,
)
from exaserve_hpc.controller.oom_guard import MemoryReading

GiB = 1 << 30


def test_reservation_devices_are_the_ones_the_pool_reserved():
    pool = MemoryPool([8 * GiB, 8 * GiB, 8 * GiB], block_size=GiB)
    pool.reserve("m/r0000", 5 * GiB)
    pool.reserve("m/r0001", 3 * GiB)
    pool.reserve("m/r0002", 4 * GiB)
    pool.reserve("m/r0003", 2 * GiB, devices=2)
    pool.release("m/r0001")
    truth = {rid: r.devices for rid, r in pool.reservations.items()}
    assert reservation_devices(pool.status()) == truth and len(truth["m/r0003"]) == 2
    assert reservation_devices(MemoryPoolStatus(block_size=1)) == {}


def test_gpu_readings_come_from_the_last_telemetry_and_a_cpu_node_reads_host_memory_as_device_0():
    gpus = [GpuInfo(index=i, name="H100", memory_total=80 * GiB, memory_used=(10 + i) * GiB) for i in range(2)]
    gpu_node = AgentRecord.from_hello("g", AgentHello(agent_id="g", hostname="g", pid=1, gpus=gpus), now=1.0)
    gpu_node.on_heartbeat(AgentHeartbeat(agent_id="g", seq=1), now=2.0)  # no NVML reading in this beat
    assert gpu_node.telemetry_at == 1.0
    assert agent_readings(gpu_node, {("g", 1): 4 * GiB}) == [
        MemoryReading("g", 0, 10 * GiB, 80 * GiB), MemoryReading("g", 1, 7 * GiB, 80 * GiB)]

    cpu_node = AgentRecord.from_hello("c", AgentHello(agent_id="c", hostname="c", pid=1, host_memory_total=64 * GiB),
                                      now=1.0)
    assert agent_readings(cpu_node) == [MemoryReading("c", 0, 0, 64 * GiB)] and cpu_node.telemetry_at == 0.0
    cpu_node.on_heartbeat(AgentHeartbeat(agent_id="c", seq=1, host_memory_used=63 * GiB), now=3.0)
    (reading,) = agent_readings(cpu_node)
    assert (reading.device, reading.used_bytes, cpu_node.telemetry_at) == (0, 63 * GiB, 3.0)
    assert is_short(reading) and not is_short(MemoryReading("c", 0, 60 * GiB, 64 * GiB))
    unknown = AgentRecord("u", "u", 1, 0.0)  # no telemetry yet: nothing to judge by
    assert agent_readings(unknown) == []


def test_fleet_plan_holds_replicas_with_a_reservation_and_counts_stopping_ones_as_releasing():
    pool = MemoryPool([8 * GiB, 8 * GiB], block_size=GiB)
    pool.reserve("low/r0000", 2 * GiB)
    pool.reserve("low/r0001", 3 * GiB)
    pool.reserve("low/r0004", GiB)
    agent = AgentRecord("a", "a", 1, 0.0, gpus=2, memory=pool.status())
    lost = AgentRecord("b", "b", 1, 0.0, memory=MemoryPoolStatus(block_size=1, total=[8], free=[0],
                                                                  reservations={"low/r0003": 8}), lost=True)
    records = [ReplicaRecord("low/r0000", "low", "a", state=ReplicaState.SERVING),
               ReplicaRecord("low/r0001", "low", "a", state=ReplicaState.SERVING, stopping=True),
               ReplicaRecord("low/r0002", "low", "a"),  # pending: nothing reserved yet
               ReplicaRecord("low/r0003", "low", "b"),  # on a lost node
               ReplicaRecord("low/r0004", "low", "a", state=ReplicaState.LOADING)]  # starting: never evicted
    plan, releasing = fleet_plan("t", [agent, lost], records)
    (only,) = plan.assignments
    assert (only.replica_id, only.stages[0].node, only.bytes_per_gpu) == ("low/r0000", "a", 2 * GiB)
    assert only.gpus == (pool.reservations["low/r0000"].devices)
    assert releasing == {("a", pool.reservations["low/r0001"].devices[0]): 3 * GiB}
    assert plan.memory_total == {"a": [8 * GiB, 8 * GiB]} and sum(plan.memory_used["a"]) == 6 * GiB


def test_request_rates_are_the_mean_of_the_demand_history_per_second():
    assert request_rates({"a": [10.0, 30.0], "b": [], "c": [0.0]}, 10.0) == {"a": 2.0, "c": 0.0}


def test_a_node_closed_for_memory_keeps_its_replicas_and_takes_no_new_one():
    site = parse_site({"site": "t", "cluster": {"nodes": 2, "nodelist": "a,b"}, "models": [{"model_name": "m"}]})
    topology, catalogue = fleet_topology(site, [{"hostname": h, "host_memory": 8 * GiB} for h in "ab"]), \
        catalogue_from_site(site)
    held = place_pending(topology, catalogue, 4, [], [("m/r0000", "m")], preferred={"m/r0000": "a"}).placed
    pending = [("m/r0001", "m"), ("m/r0002", "m")]
    both = place_pending(topology, catalogue, 4, held.values(), pending, preferred={"m/r0001": "a"},
                         closed={"a": "short"})
    assert {rid: a.node for rid, a in both.placed.items()} == {"m/r0001": "b", "m/r0002": "b"}
    alone = place_pending(topology, catalogue, 4, held.values(), pending, closed={"a": "short"}, down=["b"])
    assert not alone.placed and "closed to new replicas: a (short)" in alone.unplaced["m/r0001"]
    closed = AgentRecord("a", "a", 1, 0.0, memory=MemoryPoolStatus(block_size=1, total=[8], free=[8]),
                         memory_closed="short")
    assert closed.view(0).largest_reservable == 0  # load failover sees no room there either


class FakeFleet:
    """What OomControl uses of the Fleet: site, catalogue, agents, replicas, live_agents() and retire()."""

    def __init__(self, agents, replicas):
        self.site = parse_site({"site": "t", "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_memory": "80GiB"},
                                "scheduler": {"cooldown_period": 60},
                                "models": [{"model_name": "low", "priority": 0},
                                           {"model_name": "high", "priority": 90}]})
        self.agents = {a.agent_id: a for a in agents}
        self.replicas = {r.replica_id: r for r in replicas}
        self.catalogue = catalogue_from_site(self.site)
        self.retired: list[str] = []

    def live_agents(self):
        return [a for a in self.agents.values() if not a.lost]

    def retire(self, record, reason):
        record.stopping = True
        self.retired.append(record.replica_id)


def test_a_gpu_node_is_judged_again_only_on_telemetry_newer_than_its_last_eviction():
    pool = MemoryPool([80 * GiB], block_size=GiB)
    records = []
    for model in ("low", "high"):
        for i in range(3):
            pool.reserve(f"{model}/r{i:04d}", 10 * GiB)
            records.append(ReplicaRecord(f"{model}/r{i:04d}", model, "g", state=ReplicaState.SERVING))
    gpu = GpuInfo(index=0, name="H100", memory_total=80 * GiB, memory_used=79 * GiB)  # short by ~3 GiB
    agent = AgentRecord.from_hello("g", AgentHello(agent_id="g", hostname="g", pid=1, gpus=[gpu]), now=1.0)
    agent.on_heartbeat(AgentHeartbeat(agent_id="g", seq=1, memory=pool.status()), now=1.0)
    ctl = FakeFleet([agent], records)
    oom = OomControl(ctl, DemandHistory(["low", "high"]), 10.0)
    oom.tick(now=2.0)
    assert ctl.retired == ["low/r0002"] and agent.memory_closed
    # The evicted replica has exited and its reservation is gone, but the NVML reading is still the old one.
    pool.release("low/r0002")
    agent.on_heartbeat(AgentHeartbeat(agent_id="g", seq=2, memory=pool.status()), now=7.0)
    ctl.replicas.pop("low/r0002")
    oom.tick(now=7.0)
    assert ctl.retired == ["low/r0002"]  # no second eviction on a stale reading
    assert "cooldown_period" in agent.memory_closed  # closed for the hold, though not judged short now
    agent.on_heartbeat(AgentHeartbeat(agent_id="g", seq=3, memory=pool.status(), gpus=[gpu]), now=12.0)
    oom.tick(now=12.0)  # a fresh reading, still short: the next lowest goes
    assert ctl.retired == ["low/r0002", "low/r0001"]
    gpu_ok = GpuInfo(index=0, name="H100", memory_total=80 * GiB, memory_used=40 * GiB)
    agent.on_heartbeat(AgentHeartbeat(agent_id="g", seq=4, memory=pool.status(), gpus=[gpu_ok]), now=100.0)
    oom.tick(now=100.0)
    assert ctl.retired == ["low/r0002", "low/r0001"] and agent.memory_closed == ""
