"""The OOM guard on the controller's side: readings and plan from the fleet, evictions carried out.

Every `interval` (the heartbeat interval) the controller hands `OomControl.tick` its records; it builds
the pure guard's (oom_guard.py) inputs and stops what the guard evicts the way a scale-down does
(`Fleet.retire`: drained in the router, then stopped; nothing accepted is lost).

Inputs, from each live agent's latest heartbeat:
- readings (`agent_readings`): one per GPU from the agent's NVML telemetry (agents send it every few
  beats; the last one is kept); on a node without GPUs, host memory (the whole host's, as the OS counts
  it, L2 included) as device 0, which is how the memory pool and the topology model a CPU node. Bytes
  still reserved by replicas already stopping are counted as free: they are on their way out, and
  evicting another replica for them would evict twice for one shortage.
- plan (`fleet_plan`): one Assignment per replica that holds a reservation in its agent's pool and is not
  stopping, on the devices the pool reports for it.
- request rate per model: the mean of the demand history (requests per sample interval) per second.

A node where the guard acted is looked at again only once fresh telemetry has arrived from it, so a stale
NVML reading does not evict a second replica for a shortage the first eviction already covers.

Anti-thrash: a node is closed to placement (`AgentRecord.memory_closed`; placement skips it and load
failover sees no free memory there) while it is short, and for `scheduler.cooldown_period` after an
eviction on it, so the autoscaler's replacement for an evicted replica goes to another node or waits,
instead of being started on the node that just ran short.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from exaserve_hpc import metrics
from exaserve_hpc.protocol import MemoryPoolStatus
from exaserve_hpc.controller.fleet_state import AgentRecord, ReplicaRecord
from exaserve_hpc.controller.oom_guard import MemoryReading, OomDecision, oom_guard
from exaserve_hpc.controller.plan import Assignment, Plan, Stage

if TYPE_CHECKING:
    from exaserve_hpc.controller.demand import DemandHistory
    from exaserve_hpc.controller.fleet import Fleet

log = logging.getLogger("exaserve.oom")

MARGIN = 0.05  # fraction of each device kept free; a device above 1 - MARGIN is short
KEPT_EVICTIONS = 32  # evictions status() lists, newest last


def reservation_devices(pool: MemoryPoolStatus) -> dict[str, tuple[int, ...]]:
    """replica id -> the pool devices its reservation is on, as the agent's pool reports them."""
    return {rid: tuple(pool.devices[rid]) for rid in pool.reservations if pool.devices.get(rid)}


def fleet_plan(site: str, agents: Iterable[AgentRecord], replicas: Iterable[ReplicaRecord]
               ) -> tuple[Plan, dict[tuple[str, int], int]]:
    """The guard's Plan of the serving replicas holding memory on live agents, and the bytes per
    (node, device) still reserved by replicas already stopping. Replicas still starting hold memory
    too but are not in the plan: they are not evicted, and the guard's "never a model's last replica"
    then means its last serving one."""
    pools = {a.agent_id: a.memory for a in agents if not a.lost and a.memory is not None}
    assignments, releasing = [], {}
    where = {node: reservation_devices(pool) for node, pool in pools.items()}
    for record in replicas:
        node = record.agent_id or ""
        gpus = where.get(node, {}).get(record.replica_id)
        if not gpus:
            continue  # not placed, or nothing reserved yet: holds no memory
        pool = pools[node]
        per_device = pool.reservations[record.replica_id] // len(gpus)
        if record.stopping:
            for d in gpus:
                releasing[(node, d)] = releasing.get((node, d), 0) + per_device
            continue
        if not record.serving:
            continue
        assignments.append(Assignment(record.replica_id, record.model, (Stage(node, gpus),),
                                      per_device, per_device / max(1, pool.total[gpus[0]])))
    used = {n: [t - f for t, f in zip(p.total, p.free)] for n, p in pools.items()}
    total = {n: list(p.total) for n, p in pools.items()}
    return Plan(site, assignments, used, total, fault_group_of={n: n for n in pools}), releasing


def agent_readings(agent: AgentRecord, releasing: Mapping[tuple[str, int], int] = {}) -> list[MemoryReading]:
    """Memory in use per device of one agent (see the module docstring); none before the first reading."""
    node = agent.agent_id
    if agent.gpus:
        raw = [(g.index, g.memory_used, g.memory_total) for g in agent.gpu_telemetry]
    else:
        raw = [(0, agent.host_memory_used, agent.host_memory_total)] if agent.host_memory_total else []
    return [MemoryReading(node, d, max(0, used - releasing.get((node, d), 0)), total) for d, used, total in raw]


def is_short(reading: MemoryReading, margin: float = MARGIN) -> bool:
    """The guard's test (oom_guard.py): in use + margin x total is over total."""
    return int(reading.used_bytes + margin * reading.total_bytes - reading.total_bytes) > 0


def request_rates(history: Mapping[str, list[float]], interval: float) -> dict[str, float]:
    """Requests per second per model: the demand history's mean (requests per `interval`-second sample)."""
    return {m: sum(h) / len(h) / interval for m, h in history.items() if h and interval > 0}


class OomControl:
    """Runs the OOM guard on the controller thread (lock held): `tick(now)` from the controller's tick.
    Request rates come from `demand` (samples of `demand_interval` seconds)."""

    def __init__(self, fleet: "Fleet", demand: "DemandHistory", demand_interval: float, margin: float = MARGIN):
        self.fleet = fleet
        self.demand = demand
        self.demand_interval = demand_interval
        self.margin = margin
        self.interval = fleet.site.heartbeat.interval  # seconds between checks
        self.hold = fleet.site.scheduler.cooldown_period  # a node stays closed this long after an eviction
        self.catalogue = fleet.catalogue
        self.evictions: deque[dict] = deque(maxlen=KEPT_EVICTIONS)  # for status()
        self.unresolved: list[str] = []  # the latest check's
        self._next_check = 0.0
        self._acted_at: dict[str, float] = {}  # node -> telemetry_at of the reading we last evicted on
        self._closed_until: dict[str, float] = {}  # node -> clock() its post-eviction hold ends
        self._warned: dict[str, str] = {}  # device -> the unresolved reason last logged for it

    def tick(self, now: float) -> None:
        if now < self._next_check:
            return
        self._next_check = now + self.interval
        fleet = self.fleet
        live = fleet.live_agents()
        plan, releasing = fleet_plan(fleet.site.site, live, fleet.replicas.values())
        fresh = [a for a in live if a.telemetry_at > self._acted_at.get(a.agent_id, -1.0)]
        readings = [r for a in fresh for r in agent_readings(a, releasing)]
        decision = oom_guard(plan, self.catalogue, readings, request_rates(self.demand.history(), self.demand_interval),
                             self.margin)
        self._evict(decision, now)
        self._warn(decision.unresolved)
        short = {r.node for r in readings if is_short(r, self.margin)}
        for agent in live:
            if agent.agent_id in short:
                agent.memory_closed = f"short of device memory (over {1 - self.margin:.0%} in use)"
            elif now < self._closed_until.get(agent.agent_id, 0.0):
                agent.memory_closed = "short of device memory: an OOM eviction ran here; closed for scheduler.cooldown_period"
            else:
                agent.memory_closed = ""

    def _evict(self, decision: OomDecision, now: float) -> None:
        fleet = self.fleet
        for eviction in decision.evictions:
            record = fleet.replicas.get(eviction.replica_id)
            if record is None or record.stopping:
                continue
            log.warning("OOM guard: evicting %s (%s) from %s: %s", eviction.replica_id, eviction.model,
                        record.agent_id, eviction.reason)
            self.evictions.append({"at": round(time.time(), 3), "replica_id": eviction.replica_id,
                                   "model": eviction.model, "node": eviction.node, "device": eviction.device,
                                   "priority": round(eviction.priority, 3), "reason": eviction.reason})
            metrics.OOM_EVICTIONS.labels(eviction.model).inc()
            agent = fleet.agents.get(eviction.node)
            self._acted_at[eviction.node] = agent.telemetry_at if agent is not None else now
            self._closed_until[eviction.node] = now + self.hold
            fleet.retire(record, f"evicted by the OOM guard: {eviction.reason}")
            record.detail = f"evicted by the OOM guard: {eviction.reason}"

    def _warn(self, unresolved: list[str]) -> None:
        """Log each unresolved device once, and again only when its reason changes (the bytes short do not count)."""
        self.unresolved = list(unresolved)
        now: dict[str, str] = {}
        for line in unresolved:
            device, _, why = line.partition(" still short by ")
            now[device] = why.partition(": ")[2]
            if self._warned.get(device) != now[device]:
                log.warning("OOM guard: %s", line)
        self._warned = now
