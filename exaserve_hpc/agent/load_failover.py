"""Where to start a replica whose weights could not be loaded on its node: a pure policy for the controller.

Call protocol: on ``LoadFailed`` from agent A for replica R (R non-empty),

    tried[R].add(A)
    decision = after_load_failure(failed, nodes, tried[R])
    if decision.agent_id: start R on decision.agent_id (StartReplica as usual)
    else: leave R failed; log decision.why

``nodes`` are the controller's views of the live agents, built from their
last heartbeats. A timeout or I/O error is local to a node (its link to the
shared store), so another node is tried, best first: one that already holds
the model in L2 (no L3 read), then the one with most reservable memory, then
the fewest replicas. A checksum or checkpoint error is in the shared store
itself: every node would read the same bytes, so the decision is to give up
until the checkpoint is repaired.
"""

from __future__ import annotations

from dataclasses import dataclass

from exaserve_hpc.protocol import LoadFailed

NODE_LOCAL_REASONS = ("load_timeout", "io", "l2_full")


@dataclass(frozen=True)
class NodeView:
    agent_id: str
    replicas: int  # live replicas on it now
    largest_reservable: int  # bytes per device (MemoryPoolStatus: max of free)
    l2_ready: frozenset[str] = frozenset()  # models READY in its L2


@dataclass(frozen=True)
class LoadFailureDecision:
    agent_id: str | None  # where to start the replica next; None: do not retry
    why: str


def after_load_failure(failed: LoadFailed, nodes: list[NodeView], tried: set[str],
                       needed_bytes: int = 0) -> LoadFailureDecision:
    if failed.reason not in NODE_LOCAL_REASONS:
        return LoadFailureDecision(None, f"{failed.reason} on {failed.agent_id}: the shared store's copy of "
                                         f"{failed.model} is bad, so every node would fail; repair it first")
    candidates = [n for n in nodes if n.agent_id not in tried and n.agent_id != failed.agent_id
                  and n.largest_reservable >= needed_bytes]
    if not candidates:
        return LoadFailureDecision(None, f"no other node can take {failed.model} (tried {sorted(tried)})")
    best = min(candidates, key=lambda n: (failed.model not in n.l2_ready, -n.largest_reservable, n.replicas,
                                          n.agent_id))
    label = "l2-hit" if failed.model in best.l2_ready else "most-free-memory"
    return LoadFailureDecision(best.agent_id, f"{label}: {failed.reason} on {failed.agent_id}, "
                                              f"{failed.attempts} attempt(s)")
