"""Rebalancer: a bounded number of moves per round, each raising the worst node's headroom.

Called every ``scheduler.rebalance_interval`` (`rebalance_due` tells the loop
when). Node utilisation is the largest of: memory reserved / memory, replicas
/ max_replicas_per_node, and (when telemetry is given) the summed busy
fraction of its replicas' devices; headroom = 1 - utilisation.

Each move takes a replica off the node with the least headroom and starts it
where, after the move, both nodes have more headroom than the worst node had
before (most headroom first, ties by lowest latency). A move is
start-new-then-drain-old: the new replica (a fresh id) is placed while the
old one still holds its memory, and only once it is ready is the old one
drained and stopped; `Move.steps` spells that order out for the controller.
A move stays in its fault group, or goes to a group holding fewer replicas of
the model, so the spread never widens. Pipeline-parallel replicas are not
moved (a new copy would need a second full set of stage nodes at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from exaserve_hpc.topology import Topology
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.occupancy import Occupancy
from exaserve_hpc.controller.plan import Assignment, Plan, replica_id


@dataclass(frozen=True)
class Move:
    start: Assignment  # the new replica, started first
    drain: Assignment  # the old one, drained and stopped once `start` is ready
    reason: str

    @property
    def steps(self) -> tuple[str, ...]:
        return (f"start {self.start.replica_id} on {'+'.join(self.start.nodes)}",
                f"wait until {self.start.replica_id} is ready and registered with the router",
                f"drain {self.drain.replica_id} on {'+'.join(self.drain.nodes)}",
                f"stop {self.drain.replica_id} and release its memory")


@dataclass
class RebalanceDecision:
    plan: Plan  # the plan once every move has completed
    moves: list[Move] = field(default_factory=list)
    reason: str = ""  # why the round stopped where it did


def rebalance_due(last_round_at: float | None, now: float, interval: float) -> bool:
    return last_round_at is None or now - last_round_at >= interval


def _utilisation(occ: Occupancy, i: int, busy: list[float]) -> float:
    node = occ.topology.nodes[i]
    memory = sum(d.memory for d in node.devices)
    reserved = memory - sum(occ.free[i])
    return max(reserved / memory if memory else 1.0, occ.count[i] / occ.caps[i], busy[i] / len(node.devices))


def rebalance(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec], max_replicas_per_node: int,
              max_moves: int, replica_load: Mapping[str, float] | None = None) -> RebalanceDecision:
    """Up to `max_moves` moves; `replica_load`: replica id -> busy fraction (0..1) of its devices."""
    occ = Occupancy.from_plan(topology, plan, max_replicas_per_node)
    load = dict(replica_load or {})
    busy = [0.0] * len(topology.nodes)
    for a in plan.assignments:
        for s in a.stages:
            busy[topology.node(s.node).index] += load.get(a.replica_id, 0.0) * len(s.gpus)
    alive = [i for i, ok in enumerate(occ.alive) if ok]
    headroom = {i: 1 - _utilisation(occ, i, busy) for i in alive}
    next_index = {m: plan.next_index(m) for m in catalogue}
    moves: list[Move] = []
    reason = f"move budget of {max_moves} spent"
    for _ in range(max_moves):
        occupied = [i for i in alive if occ.count[i] > 0]
        if len(alive) < 2 or not occupied:
            reason = "fewer than two healthy nodes, or nothing placed: nothing to move"
            break
        worst = min(occupied, key=lambda i: (headroom[i], i))
        move = _best_move(occ, catalogue, worst, headroom, busy, load, next_index)
        if move is None:
            reason = (f"no move raises the worst node's headroom ({topology.nodes[worst].name} at "
                      f"{headroom[worst]:.3f}) without breaking a constraint")
            break
        moves.append(move)
        share = load.pop(move.drain.replica_id, 0.0)
        load[move.start.replica_id] = share
        for a, sign in ((move.start, 1), (move.drain, -1)):
            for s in a.stages:
                busy[topology.node(s.node).index] += sign * share * len(s.gpus)
        for i in {topology.node(move.start.node).index, worst}:
            headroom[i] = 1 - _utilisation(occ, i, busy)
    order = [a.replica_id for a in plan.assignments]
    return RebalanceDecision(occ.to_plan(plan.site, order, list(plan.unplaced)), moves, reason)


def _spread_kept(counts: dict[str, int], src: str, dst: str) -> bool:
    """Moving one replica from group src to dst keeps the model's spread across fault groups.

    After the move every group stays within one of the fullest (or the spread
    does not widen, where capacity had already made it wider), and src, which
    gains room, is not left two or more below any group.
    """
    after = dict(counts)
    after[src] -= 1
    after[dst] += 1
    before_spread = max(counts.values()) - min(counts.values())
    after_spread = max(after.values()) - min(after.values())
    if after_spread <= 1:
        return True
    return after_spread <= before_spread and after[src] >= max(after.values()) - 1


def _best_move(occ: Occupancy, catalogue: dict[str, ModelSpec], worst: int, headroom: dict[int, float],
               busy: list[float], load: dict[str, float], next_index: dict[str, int]) -> Move | None:
    topo = occ.topology
    src = topo.nodes[worst]
    before = headroom[worst]
    candidates = [a for a in occ.assignments.values()
                  if a.node == src.name and len(a.stages) == 1]
    # heaviest first: moving it frees the most
    candidates.sort(key=lambda a: (-a.bytes_per_gpu * len(a.gpus), -load.get(a.replica_id, 0.0), a.replica_id))
    destinations = sorted((i for i in headroom if i != worst),
                          key=lambda i: (-headroom[i], topo.latency_us(src.name, topo.nodes[i].name), i))
    src_group = occ.node_group[worst]
    groups = sorted(set(occ.node_group))
    for a in candidates:
        spec = catalogue[a.model]
        counts = {g: occ.model_count(a.model, g) for g in groups}
        for i in destinations:
            if headroom[i] <= before:
                break  # sorted: no later destination has more headroom
            g = occ.node_group[i]
            if g != src_group and not _spread_kept(counts, src_group, g):
                continue
            gpus = occ.find_slot(i, spec)
            if gpus is None:
                continue
            rid = replica_id(a.model, next_index[a.model])
            new = occ.make_assignment(rid, spec, [(i, gpus)])
            occ.reserve(new)  # new first: both hold memory while the old one drains
            occ.release(a)
            share = load.get(a.replica_id, 0.0) * len(a.gpus)
            busy_src, busy_dst = busy[worst] - share, busy[i] + share
            saved = busy[worst], busy[i]
            busy[worst], busy[i] = busy_src, busy_dst
            after_src, after_dst = 1 - _utilisation(occ, worst, busy), 1 - _utilisation(occ, i, busy)
            busy[worst], busy[i] = saved
            if min(after_src, after_dst) > before:
                next_index[a.model] += 1
                return Move(new, a, f"raise headroom of {src.name} from {before:.3f} to {after_src:.3f}; "
                                    f"{topo.nodes[i].name} keeps {after_dst:.3f}")
            occ.reserve(a)  # undo: this destination does not help
            occ.release(new)
    return None
