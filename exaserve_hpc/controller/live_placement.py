"""The running fleet as the planner sees it: a Topology from the agents' hellos, and placement passes.

Pure (no sockets, no clock): the controller hands in what it holds and carries out what comes back.
Every pass uses the planner's own pieces (placement.Placer, occupancy.Occupancy, failover.failover,
rebalance.rebalance), so for the same site and inventory the running controller and `exaserve plan`
place alike:

- `fleet_topology`: one Node per agent that said hello, ordered as the site lists its hosts (then by
  hello), devices from AgentHello.gpus (or the agent's memory pool on a CPU node: that pool is what a
  reservation is taken from), NVLink domains from the GPUs' reported `nvlink_domain` where every GPU has
  one, else `cluster.nvlink_domain_size`; fault groups from the site config by node name.
- `place_pending`: replicas without a node, given the ones already held: a restored (preferred) node
  first where it has room, then `Placer` in the planner's order (biggest footprint first, ids in order);
  a replica with nodes to avoid (its reservation was refused there, or it failed there past its restart
  limit) is placed in a pass of its own with those nodes closed.
- `held_plan`: the Plan of what is held, the input failover, rebalance and the invariant audit take.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.protocol import AgentHello
from exaserve_hpc.topology import Topology, topology_from_inventory
from exaserve_hpc.controller.catalogue import ModelSpec, placement_order
from exaserve_hpc.controller.cpu_bound import cpu_replica_slots, site_bounds_cpu
from exaserve_hpc.controller.occupancy import PACK, Occupancy
from exaserve_hpc.controller.placement import Placer, capacity_problem, shape_problem
from exaserve_hpc.controller.plan import Assignment, Plan, replica_index


def hello_inventory(agent_id: str, hello: AgentHello) -> dict:
    """One node's inventory entry (topology_from_inventory's format) from its agent's hello.

    GPUs as NVML reports them; else the GPUs the node was granted that NVML cannot see (Slurm GRES
    stand-ins: the pool's `device_ids`), each as big as its share of the pool; else a CPU node, one
    device as big as the pool (host memory less L2: what replicas can reserve)."""
    entry: dict = {"hostname": agent_id}
    pool = hello.memory
    if hello.gpus:
        gpus = []
        for g in hello.gpus:
            gpu = {"index": g.index, "memory": g.memory_total}
            domain = getattr(g, "nvlink_domain", -1)  # NVML's NVLink grouping, where the agent reports it
            if domain is not None and domain >= 0:
                gpu["nvlink_domain"] = domain
            gpus.append(gpu)
        entry["gpus"] = gpus
    elif pool is not None and getattr(pool, "device_ids", None) and len(pool.total) == len(pool.device_ids):
        entry["gpus"] = [{"index": i, "memory": total} for i, total in enumerate(pool.total)]
    host = pool.total[0] if pool is not None and pool.total else 0
    entry["host_memory"] = host if "gpus" not in entry and host else hello.host_memory_total
    if hello.cpus:  # the cores its replicas share (cpu_bound.py)
        entry["cpus"], entry["replica_threads"] = hello.cpus, hello.replica_threads or 1
    return entry


def fleet_topology(site: SiteConfig, inventory: Sequence[dict]) -> Topology:
    """The topology of the nodes whose agents said hello, in the site's host order, then hello order."""
    order = {h: i for i, h in enumerate(site.cluster.hostnames())}
    ranked = sorted(enumerate(inventory), key=lambda e: (order.get(e[1]["hostname"], len(order)), e[0]))
    entries = [entry for _, entry in ranked]
    if site_bounds_cpu(site):  # CPU nodes running a CPU engine: replicas x threads <= cores (cpu_bound.py)
        entries = [{**e, "cpu_slots": cpu_replica_slots(int(e.get("cpus") or 0), int(e.get("replica_threads") or 1))}
                   if not e.get("gpus") else e for e in entries]
    return topology_from_inventory(entries, site.cluster)


def _hold(occ: Occupancy, a: Assignment) -> None:
    """Count an assignment already running (Occupancy.reserve without its asserts: a node that came back
    smaller, or a restored placement, must not stop the controller; the audit reports such a plan)."""
    topo = occ.topology
    for s in a.stages:
        i = topo.node(s.node).index
        for d in s.gpus:
            if d < len(occ.free[i]):
                occ.free[i][d] -= a.bytes_per_gpu
        occ.count[i] += 1
        occ.group_stages[occ.node_group[i]] += 1
    occ._model_counts(a.model)[occ.node_group[topo.node(a.node).index]] += 1
    occ.assignments[a.replica_id] = a


def occupancy_of(topology: Topology, cap: int, held: Iterable[Assignment], down: Iterable[str] = (),
                 device_fit: str = PACK) -> Occupancy:
    """An Occupancy with every held assignment counted (those on nodes not in the topology are skipped)."""
    occ = Occupancy(topology, cap, down, device_fit)
    names = {n.name for n in topology.nodes}
    for a in held:
        if all(s.node in names for s in a.stages):
            _hold(occ, a)
    return occ


def held_plan(site_name: str, topology: Topology, cap: int, held: Iterable[Assignment],
              down: Iterable[str] = ()) -> Plan:
    """The Plan of what runs now (policies take a Plan)."""
    occ = occupancy_of(topology, cap, held, down)
    return occ.to_plan(site_name, list(occ.assignments), [])


@dataclass
class PlacementPass:
    placed: dict[str, Assignment] = field(default_factory=dict)  # replica id -> where it starts now
    unplaced: dict[str, str] = field(default_factory=dict)  # replica id -> why it waits


def _closed_note(closed: Mapping[str, str], reason: str) -> str:
    if not closed:
        return reason
    nodes = ", ".join(f"{n} ({why})" for n, why in sorted(closed.items()))
    return f"{reason}; closed to new replicas: {nodes}"


def place_pending(topology: Topology, catalogue: Mapping[str, ModelSpec], cap: int, held: Iterable[Assignment],
                  pending: Sequence[tuple[str, str]], *, preferred: Mapping[str, str] = {},
                  avoid: Mapping[str, Iterable[str]] = {}, closed: Mapping[str, str] = {},
                  down: Iterable[str] = (), device_fit: str = PACK) -> PlacementPass:
    """Place `pending` (replica id, model) around `held`; `closed` nodes (name -> why) keep what they hold
    but take nothing new, `down` nodes hold nothing. See the module docstring for the order."""
    occ = occupancy_of(topology, cap, held, down, device_fit)
    index = {n.name: n.index for n in topology.nodes}
    for name in closed:
        if name in index:
            occ.alive[index[name]] = False
    result = PlacementPass()
    unknown = {rid: model for rid, model in pending if model not in catalogue}
    result.unplaced.update({rid: f"model {m!r} is not in the site's catalogue" for rid, m in unknown.items()})
    queue = [(rid, m) for rid, m in pending if m not in unknown]
    rest = []
    for rid, model in queue:  # a restored placement goes back where it was, if there is room
        node = preferred.get(rid)
        spec = catalogue[model]
        if node in index and spec.pipeline_parallel == 1 and node not in set(avoid.get(rid, ())):
            gpus = occ.find_slot(index[node], spec)
            if gpus is not None:
                a = occ.make_assignment(rid, spec, [(index[node], gpus)])
                occ.reserve(a)
                result.placed[rid] = a
                continue
        rest.append((rid, model))
    plain = [(rid, m) for rid, m in rest if not avoid.get(rid)]
    by_model: dict[str, list[str]] = {}
    for rid, model in plain:
        by_model.setdefault(model, []).append(rid)
    placer = Placer(occ)
    for spec in placement_order({m: catalogue[m] for m in by_model}):
        rids = sorted(by_model[spec.name], key=replica_index)
        placed, missing = placer.place_many(spec, rids, shape_problem(spec, topology))
        result.placed.update((a.replica_id, a) for a in placed)
        for rid in rids[len(placed):]:
            result.unplaced[rid] = _closed_note(closed, missing[0].reason if missing else "not placed")
    for rid, model in rest:
        if avoid.get(rid):
            _place_avoiding(occ, catalogue[model], rid, set(avoid[rid]), index, closed, result)
    return result


def _place_avoiding(occ: Occupancy, spec: ModelSpec, rid: str, avoid: set[str], index: Mapping[str, int],
                    closed: Mapping[str, str], result: PlacementPass) -> None:
    """One replica in a pass of its own with `avoid` closed (a fresh Placer: its heaps would otherwise
    keep nodes this replica may not use)."""
    shut = [index[n] for n in avoid if n in index and occ.alive[index[n]]]
    for i in shut:
        occ.alive[i] = False
    try:
        problem = shape_problem(spec, occ.topology)
        a = None if problem else Placer(occ).place(spec, rid)
        if a is not None:
            result.placed[rid] = a
        else:
            why = problem or capacity_problem(spec, occ)
            result.unplaced[rid] = _closed_note(closed, f"{why} (avoiding {', '.join(sorted(avoid))})")
    finally:
        for i in shut:
            occ.alive[i] = True
