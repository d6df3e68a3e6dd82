"""Which replica takes a request: pure policies over a snapshot of replica load.

A policy sees only `ReplicaLoad` values (no sockets, no clock) and returns a
replica id or None when no candidate can take the request. The router keeps
the snapshot current from replica stats and its own outstanding counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol


@dataclass
class ReplicaLoad:
    replica_id: str
    model: str
    outstanding: int  # requests the router has sent and not seen finish
    max_batch_size: int
    queue_depth: int = 0  # as last reported by the replica
    kv_used: float = 0.0
    latency_ewma_ms: float = 0.0

    @property
    def load(self) -> float:
        """Fraction of batch capacity in use; above 1.0 requests queue at the replica."""
        return max(self.outstanding, self.queue_depth) / max(1, self.max_batch_size)


class BalancingPolicy(Protocol):
    name: str

    def choose(self, candidates: list[ReplicaLoad], exclude: frozenset[str] = frozenset()) -> Optional[str]:
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[ReplicaLoad], exclude: frozenset[str] = frozenset()) -> Optional[str]:
        usable = [c for c in candidates if c.replica_id not in exclude]
        if not usable:
            return None
        usable.sort(key=lambda c: c.replica_id)
        return usable[next(self._counter) % len(usable)].replica_id


class LeastLoad:
    """Lowest load wins; ties go to lower latency, then to the replica id (deterministic)."""

    name = "least_load"

    def choose(self, candidates: list[ReplicaLoad], exclude: frozenset[str] = frozenset()) -> Optional[str]:
        best: Optional[ReplicaLoad] = None
        for c in candidates:
            if c.replica_id in exclude:
                continue
            if best is None or (c.load, c.kv_used, c.latency_ewma_ms, c.replica_id) < (
                best.load, best.kv_used, best.latency_ewma_ms, best.replica_id
            ):
                best = c
        return best.replica_id if best else None


def make_policy(name: str) -> BalancingPolicy:
    # prefix_affinity arrives with the router issue; until then it balances by load.
    policies = {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_affinity": LeastLoad}
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policies)}") from None


def candidates_for(model: str, replicas: Iterable[ReplicaLoad]) -> list[ReplicaLoad]:
    return [r for r in replicas if r.model == model]
