"""What a scrape reads from the running control plane: plain, frozen values, copied under the fleet's lock.

`read_fleet(controller, router, keeper)` is the one place that reaches into the controller and the
router (the seam); everything downstream (the Prometheus collector, the local alert checks of
`exaserve status --watch`, the scrape benchmark's synthetic fleet) works on `FleetReadings` alone.
Nothing here is new information: the controller already holds each node's latest heartbeat
(NVML readings, host memory, L2 cache) and each replica's lifecycle state; the router holds each
replica's latest stats report (queue depth, batch, KV use, prefix-cache counts, latency) and its own
counters. The lock is held only to copy; families are built after it is released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class ReplicaReading:
    replica_id: str
    model: str
    node: str                      # stage 0's node ("" while not placed)
    state: str                     # agent/lifecycle.ReplicaState value
    restarts: int = 0
    routed: bool = False           # registered with the router: the stats below are its engine's
    queue_depth: int = 0           # requests waiting at the replica (its engine's scheduler)
    inflight: int = 0              # requests the router sent it and has not seen finish
    running: int = 0               # sequences in its running batch
    kv_used: float = 0.0           # fraction of its KV cache in use
    latency_ewma_ms: float = 0.0
    requests_finished: int = 0     # totals since the replica process started
    tokens_generated: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    kv_blocks_cached: int = 0
    ttft_ms: tuple[float, float] = (0.0, 0.0)  # its engine's p50, p99 over recent requests; 0: not measured
    tpot_ms: tuple[float, float] = (0.0, 0.0)
    breaker: str = "closed"        # closed | open | half_open
    draining: bool = False


@dataclass(frozen=True)
class GpuReading:
    index: int
    memory_total: int
    memory_used: int
    utilization: float             # percent, as NVML reports it
    temperature: float             # degrees Celsius
    power_watts: float


@dataclass(frozen=True)
class NodeReading:
    node: str
    lost: bool
    heartbeat_age: float
    host_memory_used: int = 0
    host_memory_total: int = 0
    gpus: tuple[GpuReading, ...] = ()
    l2_capacity: int = 0
    l2_used: int = 0
    l2_hits: int = 0
    l2_fills: int = 0
    l2_evictions: int = 0
    l3_bytes_read: int = 0
    closed: bool = False           # placement skips it (short of memory, or leaving)
    replicas: int = 0              # replicas placed on it (stage 0)


@dataclass(frozen=True)
class ModelReading:
    model: str
    serving: int
    target: int
    minimum: int
    pending: int = 0               # requests the router holds waiting for a replica of it


@dataclass(frozen=True)
class CheckpointReading:
    age_seconds: float             # since the last successful write (since the controller started: none yet)
    interval: float                # requeue.checkpoint_interval; 0 = no periodic writes
    failures: int                  # failed write attempts since the controller started


@dataclass(frozen=True)
class FleetReadings:
    replicas: tuple[ReplicaReading, ...]
    nodes: tuple[NodeReading, ...]
    models: tuple[ModelReading, ...]
    router: dict = field(default_factory=dict)  # the router snapshot's counters (no per-replica list)
    moves: int = 0                 # replica moves in progress (rebalancing, graceful leaves)
    oom_unresolved: int = 0        # devices short of memory the OOM guard could not relieve
    job_restarts: int = 0          # requeues this job has been through (the restored checkpoint's count)
    checkpoint: Optional[CheckpointReading] = None


def read_fleet(controller, router, keeper=None, wall: Callable[[], float] = time.time) -> FleetReadings:
    """A copy of what the controller and the router know now (see the module docstring)."""
    snapshot = router.snapshot()
    routed = {r["replica_id"]: r for r in snapshot.get("replicas", [])}
    with controller.fleet.lock:
        now = controller.clock()
        records = list(controller.replicas.values())
        replicas = tuple(_replica(r.replica_id, r.model, r.agent_id or "", r.state.value, r.restarts,
                                  routed.get(r.replica_id)) for r in records)
        placed: dict[str, int] = {}
        for r in records:
            if r.agent_id:
                placed[r.agent_id] = placed.get(r.agent_id, 0) + 1
        nodes = tuple(_node(a, now, placed.get(a.agent_id, 0)) for a in controller.agents.values())
        serving: dict[str, int] = {}
        target: dict[str, int] = {}
        for r in records:
            serving[r.model] = serving.get(r.model, 0) + r.serving
            target[r.model] = target.get(r.model, 0) + (not r.stopping)
        site = controller.site
        pending = snapshot.get("pending_by_model", {})
        models = tuple(ModelReading(m.model_name, serving.get(m.model_name, 0), target.get(m.model_name, 0),
                                    site.min_replicas(m), pending.get(m.model_name, 0)) for m in site.models)
        moves = len(getattr(controller.placement, "moves", ()))
        unresolved = len(controller.oom.unresolved)
        restored = controller.restored
    known = {r.replica_id for r in replicas}
    # A replica the router serves but the controller does not place (a stage process, a test's replica).
    extra = tuple(_replica(rid, e.get("model", ""), e.get("node", ""), "serving", 0, e)
                  for rid, e in routed.items() if rid not in known)
    checkpoint = None
    if keeper is not None:
        saved = keeper.saved_at if keeper.saved_at is not None else controller.started_at
        checkpoint = CheckpointReading(max(0.0, wall() - saved), float(keeper.interval), int(keeper.failures))
    return FleetReadings(
        replicas=replicas + extra, nodes=nodes, models=models,
        router={k: v for k, v in snapshot.items() if k != "replicas"},
        moves=moves, oom_unresolved=unresolved,
        job_restarts=restored.restart if restored is not None else 0, checkpoint=checkpoint)


def _replica(rid: str, model: str, node: str, state: str, restarts: int, routed: Optional[dict]) -> ReplicaReading:
    if routed is None:
        return ReplicaReading(rid, model, node, state, restarts)
    return ReplicaReading(
        rid, model, node or routed.get("node", ""), state, restarts, routed=True,
        queue_depth=int(routed.get("queue_depth", 0)), inflight=int(routed.get("outstanding", 0)),
        running=int(routed.get("running", 0)), kv_used=float(routed.get("kv_used", 0.0)),
        latency_ewma_ms=float(routed.get("latency_ewma_ms", 0.0)),
        requests_finished=int(routed.get("requests_finished", 0)),
        tokens_generated=int(routed.get("tokens_generated", 0)),
        prefix_hit_tokens=int(routed.get("prefix_hit_tokens", 0)),
        prefix_query_tokens=int(routed.get("prefix_query_tokens", 0)),
        kv_blocks_cached=int(routed.get("kv_blocks_cached", 0)),
        ttft_ms=(float(routed.get("ttft_ms_p50", 0.0)), float(routed.get("ttft_ms_p99", 0.0))),
        tpot_ms=(float(routed.get("tpot_ms_p50", 0.0)), float(routed.get("tpot_ms_p99", 0.0))),
        breaker=str(routed.get("breaker", "closed")), draining=bool(routed.get("draining", False)))


def _node(agent, now: float, replicas: int) -> NodeReading:
    l2 = agent.l2
    return NodeReading(
        agent.agent_id, agent.lost, max(0.0, now - agent.last_seen), agent.host_memory_used, agent.host_memory_total,
        tuple(GpuReading(g.index, g.memory_total, g.memory_used, g.utilization, g.temperature, g.power_watts)
              for g in agent.gpu_telemetry),
        l2.capacity if l2 else 0, l2.used if l2 else 0, l2.hits if l2 else 0, l2.fills if l2 else 0,
        l2.evictions if l2 else 0, l2.l3_bytes_read if l2 else 0,
        closed=bool(agent.memory_closed or agent.leaving), replicas=replicas)
