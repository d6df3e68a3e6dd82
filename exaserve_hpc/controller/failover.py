"""Failover: re-place the replicas of lost nodes (or a lost fault group) on healthy nodes.

Policy, per lost replica (whole replica: a pipeline-parallel replica that
lost one stage is restarted as a whole, its surviving stages released first):
1. fault group with the fewest replicas of its model, so the spread holds;
2. inside that, the healthy node with the fewest replicas, ties broken by the
   lowest latency from the lost node (then node order);
3. every placement constraint kept (see placement.py); what cannot be placed
   is reported with the reason and stays out of the plan.
Replicas are re-placed biggest footprint first, so large shapes find whole
NVLink domains before small ones fragment them. A re-placed replica keeps
its id: it is the same replica, restarted elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from exaserve_hpc.topology import Topology
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.occupancy import Occupancy, merge_unplaced
from exaserve_hpc.controller.placement import Placer, capacity_problem, shape_problem
from exaserve_hpc.controller.plan import Assignment, Plan, Stage, Unplaced


@dataclass(frozen=True)
class Replacement:
    replica_id: str
    model: str
    lost: tuple[Stage, ...]  # where it ran
    new: Assignment | None  # where it restarts; None: could not be placed (see reason)
    reason: str  # "re-placed near <node>" or why not


@dataclass
class FailoverDecision:
    plan: Plan  # the plan with the lost nodes down and their replicas moved
    replacements: list[Replacement] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)  # lost replicas that found no home

    @property
    def moved(self) -> int:
        return sum(1 for r in self.replacements if r.new is not None)


def failover(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec], lost_nodes: Iterable[str],
             max_replicas_per_node: int) -> FailoverDecision:
    lost = set(lost_nodes)
    unknown = sorted(n for n in lost if n not in plan.memory_total)
    if unknown:
        raise ValueError(f"lost node(s) {unknown} are not in the plan's {len(plan.memory_total)} nodes; "
                         f"report hostnames exactly as the topology names them")
    occ = Occupancy.from_plan(topology, plan, max_replicas_per_node, down=lost)
    affected = plan.on_nodes(lost)
    for a in affected:
        occ.release(a)
    for name in lost:  # a down node holds nothing
        node = topology.node(name)
        assert occ.count[node.index] == 0, f"{name} still holds replicas after release"
        occ.free[node.index] = [d.memory for d in node.devices]

    def near(a: Assignment) -> str:
        return next(s.node for s in a.stages if s.node in lost)

    def sort_key(a: Assignment) -> tuple:
        spec = catalogue[a.model]
        return (topology.node(near(a)).fault_group, -spec.footprint, a.replica_id)

    placer = Placer(occ)
    replacements: list[Replacement] = []
    unplaced: list[Unplaced] = []
    for a in sorted(affected, key=sort_key):
        spec = catalogue[a.model]
        origin = near(a)
        placer.set_near(origin, profile=None if topology.overrides else topology.node(origin).fault_group)
        problem = shape_problem(spec, topology)
        new = None if problem else placer.place(spec, a.replica_id)
        if new is None:
            reason = problem or capacity_problem(spec, occ)
            unplaced.append(Unplaced(a.model, 1, reason))
            replacements.append(Replacement(a.replica_id, a.model, a.stages, None, reason))
        else:
            replacements.append(Replacement(a.replica_id, a.model, a.stages, new, f"re-placed near {origin}"))
    new_plan = occ.to_plan(plan.site, [a.replica_id for a in plan.assignments], list(plan.unplaced) + unplaced)
    return FailoverDecision(new_plan, replacements, merge_unplaced(unplaced))


def failover_fault_group(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec], group: str,
                         max_replicas_per_node: int) -> FailoverDecision:
    """A whole fault group lost (switch, PDU): every node in it is down."""
    return failover(plan, topology, catalogue, topology.group(group).nodes, max_replicas_per_node)
