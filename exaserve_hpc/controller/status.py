"""What `Controller.status()` returns: the fleet as the gateway's /status and `exaserve status` show it.

One plain dict, safe to serialise as JSON: the controller's endpoints, each agent (alive or lost, heartbeat
age, host memory, L2 contents, closed to placement for memory), each replica (state, node, queue, restarts,
load progress), each model (replicas serving and wanted, the autoscaler's latest decision and last
scaling), the OOM guard's recent evictions and unresolved shortages, the router's counters, and the
checkpoint this run was restored from (a requeued job). It is read from any thread; the controller's
lock is held while the fleet is read, so a reader never sees a half-applied update.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from exaserve_hpc.controller.core import ControllerCore


def _finite(x: float) -> Optional[float]:
    return round(x, 3) if math.isfinite(x) else None  # JSON has no infinity (no replica serving, work queued)


def controller_status(ctl: "ControllerCore") -> dict:
    """The fleet as one JSON-ready dict (see the module docstring)."""
    snapshot = ctl.router.snapshot()
    routed = {r["replica_id"]: r for r in snapshot.get("replicas", [])}
    silent = snapshot.get("replica_silent_s") or {}  # seconds since the router last heard each replica
    if not ctl.fleet.lock.acquire(timeout=2.0):  # a stalled controller holds it: say so rather than hang
        return {"site": ctl.site.site, "controller": {"endpoint": ctl.endpoint, "started_at": ctl.started_at,
                                                      "liveness": ctl.liveness() or ["controller busy"]}}
    try:
        return {
            "site": ctl.site.site,
            "controller": {"endpoint": ctl.endpoint, "started_at": ctl.started_at,
                           "router_frontend": ctl.router.frontend_endpoint,
                           "router_backend": ctl.router.backend_endpoint,
                           "liveness": ctl.liveness() or "ok"},
            "agents": [
                # GPUs: the ones granted to the agent's step (its memory pool's devices), as NVML may not
                # report them (the count of NVML readings, a.gpus, is 0 there)
                {"agent_id": a.agent_id, "hostname": a.hostname, "pid": a.pid,
                 "gpus": len(a.memory.device_ids) if a.memory is not None and a.memory.device_ids else a.gpus,
                 "gpu_ids": list(a.memory.device_ids) if a.memory is not None else [],
                 "state": "lost" if a.lost else ("silent" if a.silent_since else "alive"),
                 "heartbeat_age": round(ctl.clock() - a.last_seen, 3),
                 "lost_since": (round(time.time() - (ctl.clock() - ctl.lost_at[a.agent_id]), 3)
                                if a.lost and a.agent_id in ctl.lost_at else None),
                 "host_memory_used": a.host_memory_used, "host_memory_total": a.host_memory_total,
                 "memory_closed": a.memory_closed or None, "suspect": a.suspect or None,
                 "leaving": a.leaving or None,
                 "l2": ({"capacity": a.l2.capacity, "used": a.l2.used,
                         "models": {e.model: e.state for e in a.l2.entries}} if a.l2 is not None else None)}
                for a in ctl.agents.values()
            ],
            "replicas": [
                {"replica_id": r.replica_id, "model": r.model, "version": r.version, "state": r.state.value,
                 "node": r.agent_id,
                 "nodes": list(r.assignment.nodes) if r.assignment else [],
                 "gpus": list(r.assignment.gpus) if r.assignment else [],
                 # every pipeline stage's node and devices (node and gpus above are stage 0's)
                 "stages": ([{"node": s.node, "gpus": list(s.gpus)} for s in r.assignment.stages]
                            if r.assignment else []),
                 "memory_bytes": r.assignment.bytes_per_gpu if r.assignment else 0,
                 "pid": r.pid, "endpoint": ctl.router.backend_endpoint if r.replica_id in routed else None,
                 "queue_depth": routed.get(r.replica_id, {}).get("queue_depth", 0),
                 "outstanding": routed.get(r.replica_id, {}).get("outstanding", 0),
                 "restarts": r.restarts, "detail": r.detail, "load_progress": r.load_progress,
                 "load_bytes_done": r.load_bytes_done, "load_bytes_total": r.load_bytes_total,
                 "load_source": r.load_source, "devices": replica_devices(ctl.agents.get(r.agent_id), r.replica_id),
                 # a replica sends stats every router.replica_heartbeat: one long silent is hung or stopped
                 # (SIGSTOP) though its process lives; the router drops it after its replica expiry
                 "silent_s": silent.get(r.replica_id), "routed": r.replica_id in routed}
                for r in ctl.replicas.values()
            ],
            "models": models_summary(ctl),
            "placement": ctl.placement.status(),
            "oom": {"evictions": list(ctl.oom.evictions), "unresolved": list(ctl.oom.unresolved)},
            "router": {k: v for k, v in snapshot.items() if k not in ("replicas", "replica_silent_s")},
            "restored": restored_summary(ctl.restored),
        }
    finally:
        ctl.fleet.lock.release()


def models_summary(ctl: "ControllerCore") -> list[dict]:
    """Per model: replicas serving (current) and wanted (target), the latest decision, the last scaling."""
    summary = []
    for model in ctl.site.models:
        name = model.model_name
        mine = [r for r in ctl.replicas.values() if r.model == name]
        latest, (scaled, at) = ctl.decisions.get(name), ctl.last_scaling.get(name, (None, 0.0))
        minimum, serving = ctl.site.min_replicas(model), sum(r.serving for r in mine)
        summary.append({
            "model": name, "min_replicas": minimum,
            "current": serving, "target": sum(not r.stopping for r in mine),
            "below_min": below_min_reason(mine) if serving < minimum else None,
            # never below its target without a reason: each replica not serving yet, and why
            "below_target": below_min_reason(mine) if serving < sum(not r.stopping for r in mine) else None,
            "bounded": ctl.bounded.get(name),
            "stopping": sum(r.stopping for r in mine),
            "load": _finite(latest.load) if latest is not None else None,
            "decision": latest.reason if latest is not None else None,
            "last_scale": ({"at": round(at, 3), "from": scaled.current, "to": scaled.target,
                            "load": _finite(scaled.load), "reason": scaled.reason}
                           if scaled is not None else None)})
    return summary


def below_min_reason(records) -> str:
    """Why a model has fewer serving replicas than its minimum: each of its replicas not serving, and why."""
    waiting = [f"{r.replica_id} {r.state.value}{' on ' + r.agent_id if r.agent_id else ''}: {r.detail}"
               for r in records if not r.serving and not r.stopping]
    return "; ".join(waiting) or "no replica of it exists yet"


def restored_summary(state) -> Optional[dict]:
    """The checkpoint.ControllerState this run started from, as JSON; None on a first run."""
    if state is None:
        return None
    return {"job_id": state.job_id, "restart": state.restart, "saved_at": state.saved_at,
            "placement": {rid: list(v) for rid, v in state.placement.items()},
            "affinity": {str(h): list(r) for h, r in state.affinity.items()},
            "quota": {g: list(v) for g, v in state.quota.items()},
            "rollout": {m: [r.version, r.stage, r.weight] for m, r in state.rollout.items()},
            "excluded_nodes": list(state.excluded_nodes)}


def replica_devices(agent, replica_id: str) -> list[str]:
    """What the replica's CUDA_VISIBLE_DEVICES holds: its reservation's devices as its node's memory pool
    names them (agent/gpu_binding.py binds exactly those); [] on a CPU node or while it holds none."""
    memory = agent.memory if agent is not None else None
    if memory is None or not memory.device_ids:
        return []
    return [memory.device_ids[i] for i in memory.devices.get(replica_id, []) if 0 <= i < len(memory.device_ids)]
