"""Placement on the controller's side: the planner's policies run on the live fleet, their decisions carried out.

Called on the controller thread with the fleet's lock held:
- `place()` every tick and after each hello: replicas without a node go where `live_placement.place_pending`
  (placement.Placer) puts them; the rest wait with the planner's reason in their detail.
- `node_lost(node)`: its replicas (any stage on it) are re-placed by `failover.failover` (fault group with
  the fewest replicas of the model, then the least-loaded node, latency from the lost node breaking ties).
- `refused(record, detail)` (the agent could not reserve what the plan said) and `gave_up(record, detail)`
  (it failed past its restart limit: the node is marked suspect) place the replica again, avoiding that node.
- `left(record)`: a replica its node stopped without being asked (the node's agent is leaving gracefully:
  SIGTERM, a drain) is a planned move: the node takes no new replica, and the replica starts elsewhere from
  the KV snapshot it wrote as it drained.
- `closing`: set when the controller shuts the fleet down; nothing is placed any more.
- `tick(now)`: every `scheduler.rebalance_interval` a `rebalance.rebalance` round of at most
  `scheduler.max_moves_per_round` moves, and the moves in flight carried on (see below).
- after any change the plan is audited with `invariants.plan_violations`; problems are logged once and
  listed in status.

A move keeps both the serving count and, where it can, the cache. The destination's memory is held in the
plan from the start (no other replica takes it). When the model has another replica serving, the old one is
drained first, writing its KV snapshot as it finishes, and the new one starts from that snapshot
(`kv_snapshot_in`), so its first request hits the moved prefix; the other replicas carry the traffic
meanwhile. When the old one is the model's only serving replica, the new one starts first and the old one
is drained once the new one serves (start-new-then-drain-old; the new one's cache starts cold): the
replica loads a snapshot only before it registers and writes one only at the end of its drain, so the two
orders cannot both hold for one move.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.controller.failover import failover
from exaserve_hpc.controller.fleet import Fleet, keeps_kv_snapshots
from exaserve_hpc.controller.fleet_state import ReplicaRecord
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.live_placement import held_plan, place_pending
from exaserve_hpc.controller.rebalance import rebalance, rebalance_due

log = logging.getLogger("exaserve.controller")

KEPT_ROUNDS = 8  # rebalance rounds status() lists, newest last
DRAIN_FIRST, START_FIRST = "drain-first", "start-first"


@dataclass
class MoveInFlight:
    old: str  # replica id being replaced
    new: str
    order: str  # DRAIN_FIRST (the cache moves) or START_FIRST (the serving count holds)
    phase: str  # "draining old", "starting new", "waiting for new to serve"


class PlacementControl:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.preferred: dict[str, str] = {}  # replica id -> node, from a restored placement
        self.moves: dict[str, MoveInFlight] = {}  # new replica id -> its move
        self.rounds: deque[dict] = deque(maxlen=KEPT_ROUNDS)
        self.violations: list[str] = []
        self._last_round: Optional[float] = None
        self.closing = False  # the fleet is shutting down: stopped replicas are not placed again
        self._dirty = False
        # spread is audited only while every placement was made with the same nodes to choose from: failover
        # and nodes joining later leave it to the rebalancer (which never widens it)
        self._spread_audit = True
        self._placed_on: frozenset[str] = frozenset()  # nodes there were when replicas were placed

    # ---------------------------------------------------------------- initial placement and scale-up

    def place(self) -> None:
        fleet = self.fleet
        if self.closing:
            return
        if self._placed_on and not frozenset(fleet.agents) <= self._placed_on:
            self._spread_audit = False  # a node joined after replicas were placed: spread is the rebalancer's job
        pending = [(rid, r.model) for rid, r in fleet.replicas.items()
                   if r.assignment is None and not r.stopping and not r.given_up]
        if not pending:
            return
        live = fleet.live_agents()
        if not live:
            for rid, _ in pending:
                fleet.replicas[rid].detail = "not placed: no live node agent"
            return
        result = place_pending(
            fleet.topology(), fleet.catalogue, fleet.cap, fleet.held(), pending, preferred=self.preferred,
            avoid={rid: fleet.replicas[rid].tried_agents for rid, _ in pending if fleet.replicas[rid].tried_agents},
            closed=closed_nodes(live), down=fleet.down())
        if result.placed:
            self._placed_on |= frozenset(fleet.agents)
        for rid, assignment in result.placed.items():
            self.preferred.pop(rid, None)
            fleet.start(fleet.replicas[rid], assignment)
            self._dirty = True
        for rid, why in result.unplaced.items():
            record = fleet.replicas[rid]
            record.detail = f"{record.failure}; not placed: {why}" if record.failure else f"not placed: {why}"

    def place_on(self, record: ReplicaRecord, node: str, why: str) -> None:
        """Start `record` on `node` if the planner finds it a slot there, else wherever it fits (avoiding
        the nodes it already failed on)."""
        fleet = self.fleet
        fleet.unplace(record, why)
        others = [n.name for n in fleet.topology().nodes if n.name != node]
        result = place_pending(fleet.topology(), fleet.catalogue, fleet.cap, fleet.held(),
                               [(record.replica_id, record.model)], avoid={record.replica_id: others},
                               down=fleet.down())
        if record.replica_id in result.placed:
            fleet.start(record, result.placed[record.replica_id])
            self._dirty = True
        else:
            self.place()

    # ---------------------------------------------------------------- failures

    def node_lost(self, node: str) -> None:
        """Re-place every replica with a stage on `node` (failover.py's policy)."""
        fleet = self.fleet
        affected = [r for r in fleet.replicas.values() if r.assignment is not None and node in r.assignment.nodes]
        for record in affected:
            fleet.router.replica_lost(record.replica_id, f"node {node} lost")
            if record.stopping:  # it was leaving anyway: not re-placed
                fleet.forget(record, f"scaled down, node {node} lost")
        affected = [r for r in affected if r.replica_id in fleet.replicas]
        if not affected:
            return
        down = (fleet.down() | set(closed_nodes(fleet.live_agents()))) - {node}
        plan = held_plan(fleet.site.site, fleet.topology(), fleet.cap, fleet.held(), down)
        decision = failover(plan, fleet.topology(), fleet.catalogue, [node], fleet.cap)
        for replacement in decision.replacements:
            record = fleet.replicas[replacement.replica_id]
            if replacement.new is None:
                record.lost_assignment = record.assignment  # adopted if the node comes back still running it
                fleet.unplace(record, f"node {node} lost; not placed: {replacement.reason}")
                continue
            # A pipeline-parallel replica's surviving stages stop with it (stage processes: see fleet.py).
            log.warning("replica %s: node %s lost, %s on %s", record.replica_id, node, replacement.reason,
                        "+".join(replacement.new.nodes))
            fleet.start(record, replacement.new)
            record.detail = f"{replacement.reason} (node {node} lost)"
        self._dirty, self._spread_audit = True, False

    def refused(self, record: ReplicaRecord, detail: str) -> None:
        """The agent refused the reservation the plan made: place the replica elsewhere."""
        node = record.agent_id or ""
        log.warning("replica %s: %s refused its reservation (%s); placing it elsewhere", record.replica_id, node,
                    detail)
        self.fleet.router.replica_lost(record.replica_id, f"reservation refused on {node}")
        self.fleet.unplace(record, f"reservation refused on {node}: {detail}", avoid=[node])
        self._dirty = True
        self.place()

    def left(self, record: ReplicaRecord, detail: str) -> None:
        """Its node stopped it unasked (a graceful leave): start it elsewhere from its KV snapshot."""
        fleet = self.fleet
        node = record.agent_id or ""
        agent = fleet.agents.get(node)
        if agent is not None:
            agent.leaving = f"stopped {record.replica_id} unasked ({detail or 'no reason given'}): leaving"
        fleet.router.replica_lost(record.replica_id, f"stopped by {node}")
        if self.closing:
            return
        log.warning("replica %s stopped by %s without being asked (%s); moving it", record.replica_id, node, detail)
        fleet.unplace(record, f"its node {node} stopped it ({detail}); moving it", avoid=[node])
        model = fleet.site.model(record.model)
        if keeps_kv_snapshots(model):
            record.kv_snapshot_in = fleet.kv_snapshot_path(record.replica_id)  # written as it drained
        self._dirty = True
        self.place()

    def gave_up(self, record: ReplicaRecord, restarts: int, detail: str) -> None:
        """Failed past its restart limit: its node is suspect, the replica goes to another one."""
        node = record.agent_id or ""
        agent = self.fleet.agents.get(node)
        if agent is not None:
            agent.suspect = f"{record.replica_id} failed {restarts} times here: {detail}"
        log.error("replica %s failed %d times on %s (%s); node marked suspect, placing the replica elsewhere",
                  record.replica_id, restarts, node, detail)
        self.fleet.unplace(record, f"failed {restarts} times on {node}", avoid=[node])
        record.failure = f"failed {restarts} times on {node}: {detail}"
        record.restarts = 0
        self._dirty = True
        self.place()

    # ---------------------------------------------------------------- rebalancing

    def tick(self, now: float) -> None:
        self._carry_moves()
        scheduler = self.fleet.site.scheduler
        if rebalance_due(self._last_round, now, scheduler.rebalance_interval):
            self._last_round = now
            if not self.moves and scheduler.max_moves_per_round > 0:
                self._round(scheduler.max_moves_per_round)
        if self._dirty:
            self._audit()

    def _round(self, max_moves: int) -> None:
        fleet = self.fleet
        if any(r.assignment is None and not r.stopping and not r.given_up for r in fleet.replicas.values()):
            return  # replicas still wait for room: placing them comes first
        if any(r.assignment is not None and not r.serving and not r.stopping for r in fleet.replicas.values()):
            return  # the fleet is still starting: moving now would move a moving target
        closed = set(closed_nodes(fleet.live_agents()))
        plan = held_plan(fleet.site.site, fleet.topology(), fleet.cap, fleet.held(), fleet.down() | closed)
        decision = rebalance(plan, fleet.topology(), fleet.catalogue, fleet.cap, max_moves, self._busy())
        started = []
        for move in decision.moves[:max_moves]:
            old = fleet.replicas.get(move.drain.replica_id)
            if old is None or not old.serving:
                continue
            started.append(self._begin_move(old, move.start, move.reason))
        if started:
            self.rounds.append({"at": round(time.time(), 3), "moves": started, "reason": decision.reason})
            log.info("rebalance: %d move(s) (%s)", len(started), decision.reason)

    def _busy(self) -> dict[str, float]:
        """replica id -> busy fraction of its devices (requests in flight / max_batch_size, at most 1), from the
        router's counters: the rebalancer weighs compute as well as memory and replica slots."""
        fleet = self.fleet
        busy = {}
        for entry in fleet.router.snapshot().get("replicas", []):
            record = fleet.replicas.get(entry["replica_id"])
            if record is not None:
                work = max(entry.get("outstanding", 0), entry.get("queue_depth", 0))
                busy[record.replica_id] = min(1.0, work / max(1, fleet.catalogue[record.model].max_batch_size))
        return busy

    def _begin_move(self, old: ReplicaRecord, start, reason: str) -> dict:
        fleet = self.fleet
        (rid,) = fleet.ids.fresh(old.model, 1)
        assignment = replace(start, replica_id=rid)
        model = fleet.site.model(old.model)
        others = [r for r in fleet.active(old.model) if r.serving and r.replica_id != old.replica_id]
        keeps_cache = keeps_kv_snapshots(model) and others
        record = ReplicaRecord(rid, old.model, version=old.version, assignment=assignment)
        fleet.replicas[rid] = record
        if keeps_cache:
            record.kv_snapshot_in = fleet.kv_snapshot_path(old.replica_id)
            fleet.keep_snapshots.add(old.replica_id)
            record.detail = f"moving from {old.agent_id}: starts once {old.replica_id} drained (KV snapshot)"
            fleet.retire(old, f"rebalance: moving to {assignment.node}")
            self.moves[rid] = MoveInFlight(old.replica_id, rid, DRAIN_FIRST, "draining old")
        else:
            fleet.start(record, assignment)
            self.moves[rid] = MoveInFlight(old.replica_id, rid, START_FIRST, "waiting for new to serve")
        self._dirty = True
        return {"from": old.replica_id, "from_node": old.agent_id, "to": rid, "to_node": assignment.node,
                "order": self.moves[rid].order, "reason": reason}

    def _carry_moves(self) -> None:
        fleet = self.fleet
        for rid, move in list(self.moves.items()):
            new, old = fleet.replicas.get(rid), fleet.replicas.get(move.old)
            if new is None or new.stopping:
                del self.moves[rid]  # the new one went (scaled down, or its node lost and not re-placed)
                if old is None:
                    fleet.discard_snapshot(move.old)
                continue
            if move.phase == "draining old" and old is None:
                if new.agent_id is None and new.assignment is not None:
                    fleet.start(new, new.assignment)
                    new.detail = f"moved from {move.old}, starting from its KV snapshot"
                move.phase = "starting new"
            elif move.phase == "waiting for new to serve" and new.serving:
                if old is not None and not old.stopping:
                    fleet.retire(old, f"rebalance: replaced by {rid} on {new.agent_id}")
                move.phase = "draining old"
            if move.phase == "starting new" and (new.serving or new.state.terminal):
                del self.moves[rid]
                fleet.discard_snapshot(move.old)  # read (or refused) by the new replica: no longer needed
            elif move.phase == "draining old" and move.order == START_FIRST and old is None:
                del self.moves[rid]

    def moving(self, model: str) -> bool:
        """A move of one of `model`'s replicas is under way (the autoscaler leaves the model alone meanwhile:
        the move's extra replica is not demand to scale down)."""
        return any(m.new in self.fleet.replicas and self.fleet.replicas[m.new].model == model
                   for m in self.moves.values())

    # ---------------------------------------------------------------- audit

    def _audit(self) -> None:
        fleet = self.fleet
        self._dirty = False
        closed = closed_nodes(fleet.live_agents())
        plan = held_plan(fleet.site.site, fleet.topology(), fleet.cap, fleet.held(), fleet.down())
        # spread is judged only where the planner had every node to choose from
        spread = self._spread_audit and not closed and not any(r.tried_agents for r in fleet.replicas.values())
        found = plan_violations(plan, fleet.topology(), fleet.catalogue, fleet.cap, spread=spread)
        for line in found:
            if line not in self.violations:
                log.error("placement invariant broken: %s", line)
        self.violations = found

    def status(self) -> dict:
        return {"violations": list(self.violations), "rebalance_rounds": list(self.rounds),
                "moves": [vars(m).copy() for m in self.moves.values()]}


def closed_nodes(live) -> dict[str, str]:
    """node -> why it takes no new replica: short of memory (OOM guard), leaving, or silent (past the heartbeat
    expiry, not yet lost: a replica failed over onto it would most likely be lost with it)."""
    closed = {}
    for a in live:
        why = a.memory_closed or a.leaving or ("silent: suspected lost" if a.silent_since else "")
        if why:
            closed[a.agent_id] = why
    return closed


def is_reservation_refusal(state: ReplicaState, detail: str) -> bool:
    """The agent's report that the pool refused a replica's reservation (node_agent: "reserve failed: ...")."""
    return state is ReplicaState.FAILED and detail.startswith("reserve failed")
