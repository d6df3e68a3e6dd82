"""What the controller knows about each node agent and replica, and the pure rules read from them.

`AgentRecord` and `ReplicaRecord` are the controller's view of each node agent
and replica (a placed replica holds the planner's `Assignment`: its nodes,
device indices and reserved bytes; live_placement.py decides them);
`model_loads` turns the records and the router's counters into the
autoscaler's input, and `pick_for_removal` chooses what a scale-down stops
(no sockets, no clock: the controller thread carries them out).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.agent.load_failover import NodeView
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello, GpuInfo, L2Status, MemoryPoolStatus
from exaserve_hpc.controller.autoscale import ModelLoad
from exaserve_hpc.controller.live_placement import hello_inventory
from exaserve_hpc.controller.plan import Assignment, replica_index


@dataclass
class AgentRecord:
    agent_id: str
    hostname: str
    pid: int
    last_seen: float
    gpus: int = 0
    host_memory_total: int = 0
    host_memory_used: int = 0
    lost: bool = False
    memory: Optional[MemoryPoolStatus] = None  # the node's memory pool, from its last heartbeat
    l2: Optional[L2Status] = None  # the node's L2 weight cache, from its last heartbeat
    prefetch_sent: dict[str, float] = field(default_factory=dict)  # model -> clock() of our last Prefetch
    gpu_telemetry: list[GpuInfo] = field(default_factory=list)  # latest NVML reading (not every heartbeat has one)
    telemetry_at: float = 0.0  # clock() of the latest memory reading (GPU telemetry, or host memory on a CPU node)
    memory_closed: str = ""  # why placement skips this node (short of memory, oom_control.py); "" = open
    inventory: dict = field(default_factory=dict)  # the node as the topology sees it (live_placement.hello_inventory)
    suspect: str = ""  # why a replica failed here past its restart limit (shown in status); "" = none
    leaving: str = ""  # why it takes no new replica: it stopped one unasked (a graceful leave); "" = staying
    silent_since: float = 0.0  # clock() when it passed heartbeat.expiry unheard (suspected, not yet lost); 0 = heard

    @classmethod
    def from_hello(cls, agent_id: str, hello: AgentHello, now: float) -> "AgentRecord":
        return cls(agent_id, hello.hostname, hello.pid, now, len(hello.gpus), hello.host_memory_total,
                   memory=hello.memory, l2=hello.l2, gpu_telemetry=list(hello.gpus),
                   telemetry_at=now if hello.gpus else 0.0, inventory=hello_inventory(agent_id, hello))

    def on_heartbeat(self, beat: AgentHeartbeat, now: float) -> None:
        """Copy the heartbeat's telemetry; agents send NVML readings only every few beats, so keep the last."""
        self.host_memory_used = beat.host_memory_used
        self.memory, self.l2 = beat.memory, beat.l2
        if beat.gpus:
            self.gpu_telemetry = list(beat.gpus)
        if beat.gpus or not self.gpus:
            self.telemetry_at = now

    def view(self, replicas: int) -> NodeView:
        free = self.memory.free if self.memory is not None and not self.memory_closed else []
        entries = self.l2.entries if self.l2 is not None else []
        ready = frozenset(e.model for e in entries if e.state == "ready")
        return NodeView(self.agent_id, replicas, max(free) if free else 0, ready)


@dataclass
class ReplicaRecord:
    replica_id: str
    model: str
    agent_id: Optional[str] = None
    version: str = ""  # model version it runs (canary rollouts); "" = the site's checkpoint
    state: ReplicaState = ReplicaState.PENDING
    pid: int = 0
    detail: str = ""
    restarts: int = 0
    restart_at: float = 0.0  # monotonic time of the next start attempt
    transitions: list[tuple[str, float]] = field(default_factory=list)
    load_progress: float = 0.0
    load_bytes_done: int = 0
    load_bytes_total: int = 0
    load_source: str = ""
    # nodes placement avoids for it: its weights did not load there (load failover), its reservation was
    # refused there, or it failed there past its restart limit; cleared once it serves
    tried_agents: set[str] = field(default_factory=set)
    stopping: bool = False  # scaled down: drained and told to stop; forgotten once it reports stopped
    assignment: Optional[Assignment] = None  # where the plan put it (stage 0's node is agent_id)
    kv_snapshot_in: str = ""  # a moved replica starts from the KV snapshot its predecessor wrote
    failure: str = ""  # why it left its last node for good (past its restart limit there), for status
    given_up: str = ""  # why it is not placed again (e.g. a bad checkpoint); "" = placement retries
    # where it ran when its node was lost and no other node had room: adopted again if that node comes
    # back still running it before it is placed elsewhere
    lost_assignment: Optional[Assignment] = None

    @property
    def serving(self) -> bool:
        return self.state is ReplicaState.SERVING and not self.stopping

    @property
    def starting(self) -> bool:
        """Placed on a node and on its way to serving (not stopping, not failed)."""
        return (self.agent_id is not None and not self.stopping and not self.state.terminal
                and self.state is not ReplicaState.SERVING)


def desired_replicas(site: SiteConfig) -> list[tuple[str, str]]:
    """(replica_id, model) for every replica the site asks for, ids stable across restarts."""
    return [(f"{m.model_name}/r{i:04d}", m.model_name) for m in site.models for i in range(site.initial_replicas(m))]


def in_flight(routed: Mapping[str, dict], rid: str) -> int:
    """Requests queued at or running on a replica, from the router snapshot's entry for it."""
    entry = routed.get(rid, {})
    return max(entry.get("outstanding", 0), entry.get("queue_depth", 0))


def model_loads(site: SiteConfig, records: Iterable[ReplicaRecord], routed: Mapping[str, dict],
                pending: Mapping[str, int] = {}) -> list[ModelLoad]:
    """One ModelLoad per site model: its serving replicas (those still routed and not draining) and the
    requests in flight on them plus those the router holds waiting for a replica (`pending`, per model:
    with none serving, they are what scales a model up from zero); `routed` maps replica id -> the
    router snapshot's entry."""
    by_model: dict[str, list[ReplicaRecord]] = {m.model_name: [] for m in site.models}
    for record in records:
        if record.model in by_model:
            by_model[record.model].append(record)
    loads = []
    for model in site.models:
        mine = by_model[model.model_name]
        serving = [r.replica_id for r in mine if r.serving and not routed.get(r.replica_id, {}).get("draining")]
        queued = sum(in_flight(routed, rid) for rid in serving) + pending.get(model.model_name, 0)
        loads.append(ModelLoad(model.model_name, len(serving), queued, site.max_batch_size(model),
                               starting=sum(r.starting for r in mine)))
    return loads


def pick_for_removal(records: Iterable[ReplicaRecord], routed: Mapping[str, dict], count: int,
                     group_of: Mapping[str, str] = {}) -> list[str]:
    """The `count` replicas a scale-down stops: those not serving first (nothing in flight), then the
    fewest requests in flight, then from the fault group holding most of the model's replicas (so the
    spread across groups holds; `group_of`: node -> fault group), then the newest.

    One choice at a time, as that rule reads, but without rescanning every replica per choice (a
    scale-down of 2,000 replicas took seconds of the controller's tick): replicas are bucketed by
    (serving, in flight), then by group, newest first; a choice looks at the lowest bucket's groups
    only (a handful), and the group counts, the only part that changes, are kept as it goes."""
    left = [r for r in records if not r.stopping]
    count = max(0, min(count, len(left)))
    if not count:
        return []
    per_group: dict[str, int] = {}
    buckets: dict[tuple, dict[str, list]] = {}  # (serving, in flight) -> group -> heap of (-index, order, id)
    for order, r in enumerate(left):
        g = group_of.get(r.agent_id or "", "")
        per_group[g] = per_group.get(g, 0) + 1
        heap = buckets.setdefault((r.serving, in_flight(routed, r.replica_id)), {}).setdefault(g, [])
        heap.append((-replica_index(r.replica_id), order, r.replica_id))
    for groups in buckets.values():
        for heap in groups.values():
            heapq.heapify(heap)
    chosen: list[str] = []
    for key in sorted(buckets):  # buckets only empty as replicas are chosen, so one pass in order
        groups = buckets[key]
        while groups and len(chosen) < count:
            # the group holding most replicas overall; ties: the newest replica, then the caller's order
            g = min(groups, key=lambda g: (-per_group[g], groups[g][0]))
            _, _, rid = heapq.heappop(groups[g])
            if not groups[g]:
                del groups[g]
            per_group[g] -= 1
            chosen.append(rid)
        if len(chosen) >= count:
            break
    return chosen
