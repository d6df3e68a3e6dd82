"""The placement plan: where every replica runs, what each device holds, what could not be placed.

A Plan is a snapshot the controller turns into agent commands; policies
(failover, autoscale, rebalance, OOM guard) take one and return a new one or
a decision about one. Replica ids are stable and readable:
``"<model>/r<index>"`` (e.g. ``"llama-3.1-8b-instruct/r0042"``); a replica
re-placed by failover keeps its id, a replica started by the rebalancer or
the autoscaler gets the model's next free index.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Stage:
    node: str
    gpus: tuple[int, ...]  # device indices on that node, all in one NVLink domain (tensor-parallel group)


@dataclass(frozen=True)
class Assignment:
    replica_id: str
    model: str
    stages: tuple[Stage, ...]  # one per pipeline stage, on distinct nodes of one fault group
    bytes_per_gpu: int  # reserved on each device the replica occupies
    fraction_per_gpu: float  # that reservation as a fraction of the device (gpu_memory_utilization on GPUs)

    @property
    def node(self) -> str:
        """The first stage's node (the only one unless pipeline-parallel)."""
        return self.stages[0].node

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.stages[0].gpus

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "model": self.model,
                "stages": [{"node": s.node, "gpus": list(s.gpus)} for s in self.stages],
                "bytes_per_gpu": self.bytes_per_gpu, "fraction_per_gpu": self.fraction_per_gpu}


class Unplaced(NamedTuple):
    model: str
    count: int
    reason: str


def replica_id(model: str, index: int) -> str:
    return f"{model}/r{index:04d}"


def replica_index(rid: str) -> int:
    """The number after '/r' in a replica id."""
    head, sep, tail = rid.rpartition("/r")
    if not sep or not tail.isdigit():
        raise ValueError(f"replica id {rid!r} is not of the form '<model>/r<number>'")
    return int(tail)


@dataclass
class Plan:
    site: str
    assignments: list[Assignment]
    memory_used: dict[str, list[int]]  # node -> bytes reserved on each device
    memory_total: dict[str, list[int]]  # node -> bytes each device has
    fault_group_of: dict[str, str]  # node -> fault group
    unplaced: list[Unplaced] = field(default_factory=list)
    down_nodes: frozenset[str] = frozenset()  # lost nodes; nothing is placed on them

    def replicas_per_model(self) -> Counter:
        return Counter(a.model for a in self.assignments)

    def replicas_per_node(self) -> Counter:
        """Replica processes per node: a pipeline-parallel replica counts once on each stage's node."""
        return Counter(s.node for a in self.assignments for s in a.stages)

    def spread(self) -> dict[str, Counter]:
        """model -> fault group -> replicas (a replica's stages share one group)."""
        out: dict[str, Counter] = {}
        for a in self.assignments:
            out.setdefault(a.model, Counter())[self.fault_group_of[a.node]] += 1
        return out

    def by_id(self) -> dict[str, Assignment]:
        return {a.replica_id: a for a in self.assignments}

    def on_nodes(self, nodes: set[str] | frozenset[str]) -> list[Assignment]:
        return [a for a in self.assignments if any(s.node in nodes for s in a.stages)]

    def next_index(self, model: str) -> int:
        """First replica index not used by this model's placed replicas."""
        used = [replica_index(a.replica_id) for a in self.assignments if a.model == model]
        return max(used, default=-1) + 1

    def unplaced_count(self, model: str | None = None) -> int:
        return sum(u.count for u in self.unplaced if model is None or u.model == model)

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "replicas": len(self.assignments),
            "replicas_per_model": dict(sorted(self.replicas_per_model().items())),
            "spread": {m: dict(sorted(c.items())) for m, c in sorted(self.spread().items())},
            "assignments": [a.to_dict() for a in self.assignments],
            "memory_used": self.memory_used,
            "memory_total": self.memory_total,
            "unplaced": [u._asdict() for u in self.unplaced],
            "down_nodes": sorted(self.down_nodes),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)
