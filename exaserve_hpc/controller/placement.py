"""Placement: a catalogue of models onto a topology, every constraint kept.

Constraints (checked independently by `invariants.plan_violations`):
- a tensor-parallel group stays inside one NVLink domain;
- pipeline stages sit on distinct nodes of one fault group;
- no device is over-committed: reservations (gpu_memory_utilization x GPU
  memory) sum to at most the device's memory, and each replica's need fits
  in its reservation;
- at most ``max_replicas_per_node`` replica processes per node (a stage counts);
- a model's replicas spread over fault groups: per-group counts differ by at
  most one unless the smaller group cannot take another replica.

How one replica is placed (`Placer.place`):
1. fault group: fewest replicas of this model (spread), then lowest latency
   from `near` (failover passes the lost node), then least loaded group;
2. node inside the group: fewest replicas, then lowest latency from `near`,
   then node order; devices inside the node: best fit in one NVLink domain
   (or emptiest first with device_fit="spread", see Occupancy.find_slot).

Speed: a lazy min-heap of groups per model and of nodes per (model, group).
Keys only grow during a pass (capacity is only taken), so a popped entry
whose key is stale is re-pushed with its current key, and a node or group
that cannot take the model is dropped for the rest of the pass: each is
examined O(1) times amortised instead of scanning every node per replica.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.topology import Topology, topology_from_site
from exaserve_hpc.units import format_size
from exaserve_hpc.controller.catalogue import ModelSpec, catalogue_from_site, placement_order
from exaserve_hpc.controller.occupancy import PACK, Occupancy
from exaserve_hpc.controller.plan import Assignment, Plan, Unplaced, replica_id


def shape_problem(spec: ModelSpec, topology: Topology) -> str | None:
    """Why no replica of `spec` could ever be placed on this topology, or None."""
    if not topology.nodes:
        return "the topology has no nodes"
    tp, pp = spec.tensor_parallel, spec.pipeline_parallel
    if tp > topology.largest_domain:
        kind = "CPU node has 1 device" if topology.is_cpu else f"largest NVLink domain has {topology.largest_domain} GPUs"
        return (f"tensor_parallel {tp} needs {tp} devices in one NVLink domain but the {kind}; "
                f"lower tensor_parallel (raise pipeline_parallel instead)")
    if pp > topology.largest_group:
        return (f"pipeline_parallel {pp} needs {pp} nodes in one fault group but the largest group has "
                f"{topology.largest_group}; lower pipeline_parallel or configure larger cluster.fault_groups")
    devices = [d for n in topology.nodes for d in n.devices]
    if not any(spec.fits_device(d) for d in devices):
        return spec.why_not_fits(devices[0])
    return None


def capacity_problem(spec: ModelSpec, occ: Occupancy) -> str:
    """Why the cluster, as occupied now, has no room for one more replica of `spec`."""
    alive = [i for i, a in enumerate(occ.alive) if a]
    if not alive:
        return "no healthy nodes are left"
    if all(occ.count[i] >= occ.caps[i] for i in alive):
        if any(occ.caps[i] < occ.cap for i in alive):  # CPU nodes bounded by their cores (cpu_bound.py)
            return (f"every healthy node already holds as many replicas as its CPU cores can run "
                    f"({', '.join(sorted({str(occ.caps[i]) for i in alive}))}: replicas x BLAS threads <= cores; "
                    f"max_replicas_per_node {occ.cap}); add nodes or cores")
        return (f"every healthy node already holds max_replicas_per_node ({occ.cap}) replicas; "
                f"raise scheduler.max_replicas_per_node or add nodes")
    dev = occ.topology.nodes[alive[0]].devices[0]
    where = f"{spec.pipeline_parallel} nodes of one fault group, each" if spec.pipeline_parallel > 1 else "node"
    return (f"out of capacity: no {where} with {spec.tensor_parallel} device(s) in one NVLink domain having "
            f"{format_size(spec.reservation(dev))} free and a replica slot; add nodes, lower replicas or "
            f"gpu_memory_utilization")


class Placer:
    """Places replicas one at a time into an Occupancy; see the module docstring for the order."""

    def __init__(self, occ: Occupancy):
        self.occ = occ
        self._near: str | None = None
        self._profile: object = None
        self._group_heaps: dict[str, list] = {}
        self._node_heaps: dict[tuple[str, int], list] = {}
        self._group_latency: dict[int, float] = {}

    def set_near(self, near: str | None, profile: object = None) -> None:
        """Prefer nodes close to `near` from now on.

        The heaps' keys depend on latencies from `near`, so they are dropped
        unless `profile` says the latencies are the same as before (failover
        passes the fault group when the topology has no per-pair overrides:
        then every node of the group sees the others alike).
        """
        profile = near if profile is None else profile
        self._near = near
        if profile != self._profile:
            self._profile = profile
            self._group_heaps.clear()
            self._node_heaps.clear()
            self._group_latency.clear()

    def reset(self) -> None:
        """Forget the heaps: call after releasing capacity, which can make dropped nodes fit again."""
        self._profile = object()
        self._group_heaps.clear()
        self._node_heaps.clear()
        self._group_latency.clear()

    def _latency_to_group(self, g: int) -> float:
        if self._near is None:
            return 0.0
        hit = self._group_latency.get(g)
        if hit is None:
            topo = self.occ.topology
            hit = min(topo.latency_us(self._near, topo.nodes[i].name) for i in self.occ.group_nodes[g])
            self._group_latency[g] = hit
        return hit

    def _group_key(self, model: str, g: int) -> tuple:
        occ = self.occ
        load = occ.group_stages[g] / occ.group_slots[g] if occ.group_slots[g] else 1.0
        return (occ.model_count(model, g), self._latency_to_group(g), load, g)

    def _node_key(self, i: int) -> tuple:
        near = self._near
        lat = 0.0 if near is None else self.occ.topology.latency_us(near, self.occ.topology.nodes[i].name)
        return (self.occ.count[i], lat, i)

    def _groups(self, model: str) -> list:
        heap = self._group_heaps.get(model)
        if heap is None:
            occ = self.occ
            heap = [self._group_key(model, g) for g in range(len(occ.group_names)) if occ.group_slots[g]]
            heapq.heapify(heap)
            self._group_heaps[model] = heap
        return heap

    def _nodes(self, model: str, g: int) -> list:
        heap = self._node_heaps.get((model, g))
        if heap is None:
            heap = [self._node_key(i) for i in self.occ.group_nodes[g] if self.occ.alive[i]]
            heapq.heapify(heap)
            self._node_heaps[(model, g)] = heap
        return heap

    def _take_nodes(self, spec: ModelSpec, g: int) -> list[tuple[int, tuple[int, ...]]] | None:
        """pp distinct nodes of group g that can each take a stage, fewest replicas first; None if too few."""
        heap = self._nodes(spec.name, g)
        chosen: list[tuple[int, tuple[int, ...]]] = []
        while heap and len(chosen) < spec.pipeline_parallel:
            key = heapq.heappop(heap)
            i = key[2]
            current = self._node_key(i)
            if current != key:
                heapq.heappush(heap, current)  # stale: another model took capacity here
                continue
            gpus = self.occ.find_slot(i, spec)
            if gpus is not None:
                chosen.append((i, gpus))
            # a node that cannot take the model now never can in this pass: it stays dropped
        if len(chosen) < spec.pipeline_parallel:
            for i, _ in chosen:
                heapq.heappush(heap, self._node_key(i))
            return None
        return chosen

    def place(self, spec: ModelSpec, rid: str) -> Assignment | None:
        """Reserve and return one replica of `spec`, or None when no group can take it."""
        heap = self._groups(spec.name)
        while heap:
            key = heap[0]
            g = key[3]
            current = self._group_key(spec.name, g)
            if current != key:
                heapq.heapreplace(heap, current)
                continue
            stages = self._take_nodes(spec, g)
            if stages is None:
                heapq.heappop(heap)  # this group is out for this model for the rest of the pass
                continue
            a = self.occ.make_assignment(rid, spec, stages)
            self.occ.reserve(a)
            heap = self._nodes(spec.name, g)
            for i, _ in stages:
                heapq.heappush(heap, self._node_key(i))
            groups = self._groups(spec.name)
            heapq.heapreplace(groups, self._group_key(spec.name, g))
            return a
        return None

    def place_many(self, spec: ModelSpec, rids: Iterable[str], problem: str | None = None
                   ) -> tuple[list[Assignment], list[Unplaced]]:
        """Place each id in turn; the first failure ends it (capacity only shrinks), the rest are unplaced."""
        rids = list(rids)
        if problem is not None:
            return [], [Unplaced(spec.name, len(rids), problem)] if rids else []
        placed: list[Assignment] = []
        for k, rid in enumerate(rids):
            a = self.place(spec, rid)
            if a is None:
                return placed, [Unplaced(spec.name, len(rids) - k, capacity_problem(spec, self.occ))]
            placed.append(a)
        return placed, []


def plan_catalogue(topology: Topology, catalogue: dict[str, ModelSpec], max_replicas_per_node: int,
                   site: str = "site", down: Iterable[str] = (), device_fit: str = PACK) -> Plan:
    """Place every model's initial replicas, biggest footprint first; ids r0000.. per model."""
    occ = Occupancy(topology, max_replicas_per_node, down, device_fit)
    placer = Placer(occ)
    unplaced: list[Unplaced] = []
    order: list[str] = []
    for spec in placement_order(catalogue):
        rids = [replica_id(spec.name, k) for k in range(spec.replicas)]
        placed, missing = placer.place_many(spec, rids, shape_problem(spec, topology))
        order += [a.replica_id for a in placed]
        unplaced += missing
    return occ.to_plan(site, order, unplaced)


def plan_site(site: SiteConfig, device_fit: str = PACK) -> Plan:
    """The controller's entry: the site's initial plan from its config alone."""
    return plan_catalogue(topology_from_site(site), catalogue_from_site(site),
                          site.scheduler.max_replicas_per_node, site.site, device_fit=device_fit)
