"""OOM guard: when a device runs short of memory, evict its lowest-priority replicas.

Input is a snapshot: one MemoryReading per device (bytes in use as the agent
measured them), the request rate per model, and the plan. A device is short
when in-use + margin x total exceeds total. Replicas with a stage on a short
device are evicted lowest priority first until the shortage is covered,
counting each eviction as freeing its reservation on every device it holds.
The last replica of a model is never evicted; a device that stays short for
that reason is reported as unresolved.

Priority (0..1, higher is kept longer) blends three things:
- configured importance: ``priority`` / 100 (weight 0.5);
- demand: the model's request rate per replica, relative to the busiest
  model's (weight 0.3);
- size: log of weight bytes relative to the largest model's, because a big
  model costs the most to reload (weight 0.2).
Ties evict the newest replica (highest index) first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from exaserve_hpc.units import format_size
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.plan import Assignment, Plan, replica_index

IMPORTANCE_WEIGHT, DEMAND_WEIGHT, SIZE_WEIGHT = 0.5, 0.3, 0.2


@dataclass(frozen=True)
class MemoryReading:
    node: str
    device: int  # GPU index; 0 for a CPU node's host memory
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Eviction:
    replica_id: str
    model: str
    node: str
    device: int  # the short device that caused it
    freed_bytes: int  # per device the replica held
    priority: float
    reason: str


@dataclass
class OomDecision:
    evictions: list[Eviction] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # devices still short, and why


def replica_priorities(catalogue: Mapping[str, ModelSpec], replicas_per_model: Mapping[str, int],
                       request_rate: Mapping[str, float]) -> dict[str, float]:
    """model -> priority in 0..1 (see the module docstring)."""
    per_replica = {m: request_rate.get(m, 0.0) / max(replicas_per_model.get(m, 0), 1) for m in catalogue}
    top_rate = max(per_replica.values(), default=0.0)
    top_size = max((math.log1p(s.weight_bytes or 0) for s in catalogue.values()), default=0.0)
    out = {}
    for m, spec in catalogue.items():
        demand = per_replica[m] / top_rate if top_rate > 0 else 0.0
        size = math.log1p(spec.weight_bytes or 0) / top_size if top_size > 0 else 0.0
        out[m] = IMPORTANCE_WEIGHT * spec.priority / 100 + DEMAND_WEIGHT * demand + SIZE_WEIGHT * size
    return out


def oom_guard(plan: Plan, catalogue: Mapping[str, ModelSpec], readings: Iterable[MemoryReading],
              request_rate: Mapping[str, float], margin: float = 0.05) -> OomDecision:
    """Evictions that bring every device back under (1 - margin) of its memory, where allowed."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin is a fraction of device memory kept free, 0 <= margin < 1; got {margin}")
    readings = list(readings)
    used = {(r.node, r.device): r.used_bytes for r in readings}
    total = {(r.node, r.device): r.total_bytes for r in readings}

    def deficit(key: tuple[str, int]) -> int:
        return int(used[key] + margin * total[key] - total[key])

    short = [k for k in used if deficit(k) > 0]
    decision = OomDecision()
    if not short:
        return decision
    alive = Counter(a.model for a in plan.assignments)
    priority = replica_priorities(catalogue, alive, request_rate)
    on_device: dict[tuple[str, int], list[Assignment]] = {}
    for a in plan.assignments:
        for s in a.stages:
            for d in s.gpus:
                on_device.setdefault((s.node, d), []).append(a)
    evicted: set[str] = set()
    for key in sorted(short, key=lambda k: -deficit(k)):
        node, device = key
        while deficit(key) > 0:
            candidates = [a for a in on_device.get(key, []) if a.replica_id not in evicted and alive[a.model] > 1]
            if not candidates:
                kept = sorted({a.model for a in on_device.get(key, []) if a.replica_id not in evicted})
                decision.unresolved.append(
                    f"{node}/{device} still short by {format_size(deficit(key))}: "
                    + (f"the replicas left there are the last of {', '.join(kept)}, which are never evicted; "
                       f"add memory or lower gpu_memory_utilization" if kept else
                       "no planned replica holds it: memory is used outside the plan; check the node agent"))
                break
            victim = min(candidates, key=lambda a: (priority.get(a.model, 0.0), -replica_index(a.replica_id)))
            before = deficit(key)
            evicted.add(victim.replica_id)
            alive[victim.model] -= 1
            for s in victim.stages:
                for d in s.gpus:
                    if (s.node, d) in used:
                        used[(s.node, d)] -= victim.bytes_per_gpu
            decision.evictions.append(Eviction(
                victim.replica_id, victim.model, node, device, victim.bytes_per_gpu, priority.get(victim.model, 0.0),
                f"{node}/{device} short by {format_size(before)}: evict lowest priority {victim.replica_id} "
                f"(priority {priority.get(victim.model, 0.0):.3f}), frees {format_size(victim.bytes_per_gpu)}"))
    return decision
