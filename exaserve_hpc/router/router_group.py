"""Several routers sharing the fleet (router.count > 1), seen by the controller as one router.

    group = RouterGroup([ZmqRouter(...), ZmqRouter(...)])         # `exaserve serve`: all in this process
    group = RouterGroup([rank0_router, RemoteRouter(info), ...])   # `exaserve launch`: router k on rank k
    group.backend_endpoints        # every router's backend: each replica connects one DEALER to each
    group.replica_lost(rid, why)   # the controller's news (loss, drain) goes to every router
    group.snapshot()               # router 0's view with every live router's counts added

The controller, the fleet, status and /metrics use a router through five things: replica_lost, drain,
snapshot, the endpoints and call (rollouts); the group gives them those, fanned out.

How the routers share the fleet, and why:
- Every replica says hello to every router and sends each its stats (agent/router_links.py), so each
  router sees every replica, expires it on its own, and knows the engine's queue depth and running
  requests. A router's load for a replica is max(its own outstanding requests, the replica's reported
  queue depth) (balancing.ReplicaLoad): its own count is exact and immediate, the reported figure
  (every router.replica_heartbeat) carries the other routers' work. Sharing per-request counts between
  routers would put a message on every request's path; the report is already there.
- The prefix index: with `prefix_mode: precise` every router subscribes to every replica's KV events
  (the hello names the endpoint), so all indexes hold what the engines hold, whoever routed. With
  `approximate` each router learns from its own choices only: a conversation that stays on one gateway
  (as a client's usually does) keeps its affinity; across gateways it may land elsewhere once.
  Precise is the mode to use with several routers.
- A request belongs to the router that took it: its answers come back on that router's socket, so a
  router lost costs only its own in-flight requests; the other routers never depended on it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Optional, TypeVar

from exaserve_hpc.router.router_link import RemoteRouter
from exaserve_hpc.router.zmq_router import ZmqRouter

T = TypeVar("T")

SUMMED = ("accepted", "completed", "failed", "retries", "breaker_opened", "inflight", "pending",
          "prefix_hit_tokens", "prefix_query_tokens", "chunks_from_replicas", "chunk_frames_from_replicas",
          "chunks_to_gateways", "chunk_frames_to_gateways")


def in_process(member) -> bool:
    """A router of this process (its dispatcher can be called), not another rank's (RemoteRouter)."""
    return isinstance(member, ZmqRouter)


def member_alive(member) -> bool:
    """A member routes now (RouterPort.routing: a ZmqRouter's loop runs, a RemoteRouter's reports arrive)."""
    return member.routing()


def merge_snapshots(snapshots: list[dict]) -> dict:
    """Router 0's snapshot (the first live one) with the others' counts added (pure; dicts in, dict out).

    Replicas: each entry's `outstanding` becomes the sum over routers (what the fleet has sent it);
    the engine's own figures (queue depth, running, latency) are the same report everywhere."""
    if not snapshots:
        return {"replicas": [], "inflight": 0, "pending": 0, "pending_by_model": {}, "routing": {}}
    merged = dict(snapshots[0])
    replicas = {r["replica_id"]: dict(r) for r in snapshots[0].get("replicas", [])}
    pending_by_model = dict(merged.get("pending_by_model", {}))
    routing = dict(merged.get("routing", {}))
    for other in snapshots[1:]:
        for key in SUMMED:
            if key in other:
                merged[key] = merged.get(key, 0) + other[key]
        for model, n in other.get("pending_by_model", {}).items():
            pending_by_model[model] = pending_by_model.get(model, 0) + n
        for reason, n in other.get("routing", {}).items():
            routing[reason] = routing.get(reason, 0) + n
        if other.get("replica_silent_s"):  # heard by any router counts (controller/liveness.py): the least
            silent = merged["replica_silent_s"] = dict(merged.get("replica_silent_s") or {})
            for rid, age in other["replica_silent_s"].items():
                silent[rid] = min(age, silent.get(rid, age))
        for entry in other.get("replicas", []):
            mine = replicas.get(entry["replica_id"])
            if mine is None:  # registered with that router, not (yet) with the first
                replicas[entry["replica_id"]] = dict(entry)
            else:
                mine["outstanding"] = mine.get("outstanding", 0) + entry.get("outstanding", 0)
    merged["replicas"] = [replicas[r] for r in sorted(replicas)]
    merged["pending_by_model"] = pending_by_model
    merged["routing"] = routing
    return merged


class RouterGroup:
    def __init__(self, members: list, gateways: Optional[list[str]] = None, borrowed: tuple = ()):
        """borrowed: members whose lifetime is not the group's (an HA leader's own rank's router, which
        outlives its leadership): stop() leaves them running."""
        if not members:
            raise ValueError("a router group needs at least one router")
        self.members = list(members)
        self.borrowed = {id(m) for m in borrowed}
        self.gateways = list(gateways or [""] * len(members))  # each router's gateway URL, where known
        self._lock = threading.Lock()
        # Routers of other ranks register after the group is made: called before the endpoints are read
        # (a replica started must connect to every router there is) and before each snapshot.
        # discover(force): force=True (a replica about to start) looks at once, not at most every 0.1 s
        self.discover: Callable[..., None] = lambda force=False: None
        for member in self.members[1:]:
            self._wire(member)
        self._announce()

    # ---------------------------------------------------------------- endpoints

    @property
    def frontend_endpoint(self) -> str:
        return self.members[0].frontend_endpoint

    @property
    def backend_endpoint(self) -> str:
        return self.members[0].backend_endpoint

    @property
    def backend_endpoints(self) -> list[str]:
        """Every router's backend, router 0 first: what each replica connects to (StartReplica)."""
        self.discover(force=True)  # a router registered a moment ago must be among them
        with self._lock:
            return [m.backend_endpoint for m in self.members]

    @property
    def frontend_endpoints(self) -> list[str]:
        with self._lock:
            return [m.frontend_endpoint for m in self.members]

    def add(self, member, gateway: str = "") -> None:
        """A router that came up after the group was made (a router rank's registration)."""
        with self._lock:
            self.members.append(member)
            self.gateways.append(gateway)
        self._wire(member)
        self._announce()

    def _announce(self) -> None:
        """Tell the routers in this process every router's backend: each tells the replicas it knows, and
        any whose hello lacks one, so a replica started before a router registered links to it too
        (dispatch.set_routers, agent/router_links.py). A router of another rank need not: every replica
        links to router 0, which is in this process."""
        if len(self.members) < 2:
            return
        with self._lock:
            backends = [m.backend_endpoint for m in self.members]
        for member in list(self.members):
            if in_process(member):
                member.call(lambda d: d.set_routers(backends))

    def _wire(self, member) -> None:
        if isinstance(member, RemoteRouter):  # a router of another rank follows router 0's canary rollouts
            member.rollouts = lambda: self.members[0].snapshot().get("rollouts")

    def routing(self) -> bool:
        """RouterPort: the service works while one member routes (the controller's liveness check)."""
        return any(member_alive(member) for member in list(self.members))

    # ---------------------------------------------------------------- the controller's news, fanned out

    def replica_lost(self, replica_id: str, cause: str) -> None:
        for member in list(self.members):
            member.replica_lost(replica_id, cause)

    def drain(self, replica_id: str) -> None:
        for member in list(self.members):
            member.drain(replica_id)

    def call(self, fn: Callable[..., T]) -> "Future[T]":
        """Run fn(dispatcher) on every router in this process (rollouts: each router's table); the first
        router's result. Routers on other ranks follow it: each report request on their control link carries
        router 0's rollout table, which they take when it differs (router_link.py), within REPORT_INTERVAL."""
        futures = [m.call(fn) for m in list(self.members) if in_process(m) and member_alive(m)]
        if not futures:
            return self.members[0].call(fn)
        return futures[0]

    # ---------------------------------------------------------------- status

    def snapshot(self) -> dict:
        self.discover()
        with self._lock:
            members, gateways = list(self.members), list(self.gateways)
        own = [m.snapshot() if member_alive(m) else None for m in members]
        merged = merge_snapshots([s for s in own if s is not None])
        merged["routers"] = [
            {"index": k, "frontend": m.frontend_endpoint, "backend": m.backend_endpoint, "gateway": gateways[k],
             "state": "lost" if s is None else "serving", "replicas": len((s or {}).get("replicas", [])),
             "accepted": (s or {}).get("accepted", 0), "inflight": (s or {}).get("inflight", 0)}
            for k, (m, s) in enumerate(zip(members, own))]
        return merged

    def stop(self, timeout: float = 5.0) -> None:
        for member in list(self.members):
            if id(member) not in self.borrowed:
                member.stop(timeout)
