"""Mutable bookkeeping for one planning pass: free bytes per device, replicas per node and per group.

Policies copy a Plan into an Occupancy, decide, and turn the result back into
a new Plan; the Plan itself is never mutated. Everything is indexed by node
position (``Node.index``) so the hot paths are list lookups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from exaserve_hpc.topology import Node, Topology
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.cpu_bound import node_replica_cap
from exaserve_hpc.controller.plan import Assignment, Plan, Stage, Unplaced


PACK, SPREAD = "pack", "spread"


class Occupancy:
    def __init__(self, topology: Topology, max_replicas_per_node: int, down: Iterable[str] = (),
                 device_fit: str = PACK):
        if device_fit not in (PACK, SPREAD):
            raise ValueError(f"device_fit must be {PACK!r} or {SPREAD!r}, got {device_fit!r}")
        self.device_fit = device_fit
        self.topology = topology
        self.cap = max_replicas_per_node
        # per node: the cap, lowered on CPU nodes to the replicas their cores can run (cpu_bound.py)
        self.caps: list[int] = [node_replica_cap(max_replicas_per_node, n.cpu_slots) for n in topology.nodes]
        self.free: list[list[int]] = [[d.memory for d in n.devices] for n in topology.nodes]
        self.count: list[int] = [0] * len(topology.nodes)
        self.down: set[str] = set(down)
        self.alive: list[bool] = [n.name not in self.down for n in topology.nodes]
        self.group_names: list[str] = [g.name for g in topology.groups]
        self.group_index: dict[str, int] = {g: i for i, g in enumerate(self.group_names)}
        self.node_group: list[int] = [self.group_index[n.fault_group] for n in topology.nodes]
        self.group_nodes: list[list[int]] = [[topology.node(h).index for h in g.nodes] for g in topology.groups]
        self.group_stages: list[int] = [0] * len(topology.groups)  # replica processes per group
        self.group_slots: list[int] = [sum(self.caps[i] for i in nodes if self.alive[i])
                                       for nodes in self.group_nodes]
        self.model_groups: dict[str, list[int]] = {}  # model -> replicas per group index
        self.assignments: dict[str, Assignment] = {}

    @classmethod
    def from_plan(cls, topology: Topology, plan: Plan, max_replicas_per_node: int,
                  down: Iterable[str] = ()) -> "Occupancy":
        occ = cls(topology, max_replicas_per_node, set(plan.down_nodes) | set(down))
        for n in topology.nodes:
            used = plan.memory_used.get(n.name)
            if used is not None:
                occ.free[n.index] = [d.memory - u for d, u in zip(n.devices, used)]
        index = {n.name: n.index for n in topology.nodes}
        for a in plan.assignments:
            for s in a.stages:
                i = index[s.node]
                occ.count[i] += 1
                occ.group_stages[occ.node_group[i]] += 1
            occ._model_counts(a.model)[occ.node_group[index[a.node]]] += 1
            occ.assignments[a.replica_id] = a
        return occ

    def _model_counts(self, model: str) -> list[int]:
        counts = self.model_groups.get(model)
        if counts is None:
            counts = self.model_groups[model] = [0] * len(self.group_names)
        return counts

    def model_count(self, model: str, group: int) -> int:
        return self._model_counts(model)[group]

    def group_alive(self, group: int) -> bool:
        return any(self.alive[i] for i in self.group_nodes[group])

    # ------------------------------------------------------------ fitting

    def find_slot(self, node: int, spec: ModelSpec) -> tuple[int, ...] | None:
        """Devices of one NVLink domain on `node` that can take one stage of `spec`; None if none.

        PACK (default): fullest devices that fit (best fit), which keeps whole
        GPUs and domains free for tensor-parallel replicas re-placed by
        failover or added by the autoscaler. SPREAD: emptiest first, so small
        replicas use every GPU's compute before doubling up.
        """
        if not self.alive[node] or self.count[node] >= self.caps[node]:
            return None
        n: Node = self.topology.nodes[node]
        free = self.free[node]
        tp = spec.tensor_parallel
        best: tuple[int, ...] | None = None
        best_slack = -1
        for domain in n.nvlink_domains:
            if len(domain) < tp:
                continue
            ok = []
            for d in domain:
                dev = n.devices[d]
                claim = spec.reservation(dev)
                if free[d] >= claim and spec.need_per_device <= claim:
                    ok.append((free[d] - claim, d))
            if len(ok) < tp:
                continue
            sign = 1 if self.device_fit == PACK else -1
            ok.sort(key=lambda item: (sign * item[0], item[1]))
            chosen = ok[:tp]
            slack = sign * sum(s for s, _ in chosen)
            if best is None or slack < best_slack:
                best, best_slack = tuple(sorted(d for _, d in chosen)), slack
        return best

    # ------------------------------------------------------------ changes

    def reserve(self, a: Assignment) -> None:
        topo = self.topology
        for s in a.stages:
            n = topo.node(s.node)
            assert self.alive[n.index], f"{a.replica_id}: node {s.node} is down"
            assert self.count[n.index] < self.caps[n.index], \
                f"{a.replica_id}: {s.node} already holds {self.caps[n.index]} replicas"
            for d in s.gpus:
                self.free[n.index][d] -= a.bytes_per_gpu
                assert self.free[n.index][d] >= 0, f"{a.replica_id}: {s.node} device {d} over-committed"
            self.count[n.index] += 1
            self.group_stages[self.node_group[n.index]] += 1
        self._model_counts(a.model)[self.node_group[topo.node(a.node).index]] += 1
        self.assignments[a.replica_id] = a

    def release(self, a: Assignment) -> None:
        topo = self.topology
        for s in a.stages:
            n = topo.node(s.node)
            for d in s.gpus:
                self.free[n.index][d] += a.bytes_per_gpu
            self.count[n.index] -= 1
            self.group_stages[self.node_group[n.index]] -= 1
        self._model_counts(a.model)[self.node_group[topo.node(a.node).index]] -= 1
        del self.assignments[a.replica_id]

    def make_assignment(self, rid: str, spec: ModelSpec, nodes_and_gpus: list[tuple[int, tuple[int, ...]]]) -> Assignment:
        first = self.topology.nodes[nodes_and_gpus[0][0]]
        dev = first.devices[nodes_and_gpus[0][1][0]]
        claim = spec.reservation(dev)
        return Assignment(rid, spec.name,
                          tuple(Stage(self.topology.nodes[i].name, gpus) for i, gpus in nodes_and_gpus),
                          claim, claim / dev.memory)

    # ------------------------------------------------------------ output

    def to_plan(self, site: str, order: list[str], unplaced: list[Unplaced]) -> Plan:
        """A Plan with assignments in `order` (replica ids), then any others in insertion order."""
        seen = set(order)
        assignments = [self.assignments[r] for r in order if r in self.assignments]
        assignments += [a for r, a in self.assignments.items() if r not in seen]
        topo = self.topology
        return Plan(
            site=site,
            assignments=assignments,
            memory_used={n.name: [d.memory - f for d, f in zip(n.devices, self.free[n.index])] for n in topo.nodes},
            memory_total={n.name: [d.memory for d in n.devices] for n in topo.nodes},
            fault_group_of={n.name: n.fault_group for n in topo.nodes},
            unplaced=merge_unplaced(unplaced),
            down_nodes=frozenset(self.down),
        )


def merge_unplaced(items: Iterable[Unplaced]) -> list[Unplaced]:
    """One entry per (model, reason), counts summed, in first-seen order."""
    totals: Counter = Counter()
    for u in items:
        totals[(u.model, u.reason)] += u.count
    return [Unplaced(m, c, r) for (m, r), c in totals.items() if c > 0]
