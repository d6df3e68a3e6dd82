"""The controller's core: agent messages and a clock in, replica commands out. No socket, no thread.

    core = ControllerCore(site, router, clock=...)
    core.handle(agent_id, message)   # AgentHello, AgentHeartbeat, ReplicaEvent, LoadFailed, StageHello
    core.tick(now)                   # lost nodes, restarts, autoscaling, rollouts, OOM guard, placement
    core.take_effects()              # [(agent_id, message)]: what to send (StartReplica, StopReplica, ...)

`Controller` (loop.py) is this core plus the thread that owns the ROUTER socket every node agent's
DEALER connects to; the simulator (sim/simulation.py) and the tests drive the core directly. The core records agent hellos, heartbeats and replica events; asks agents to start
the replicas the placement gives their node; restarts a failed replica (a
bounded number of times, with backoff); suspects a node after
`heartbeat.misses` intervals silent on every channel and declares it lost a grace
later (liveness.py: any message of its agent or of its replicas at the router
counts as life, `exaserve serve` checks its agent process directly, and the
grace widens with the node's observed heartbeat lateness), taking its replicas out of routing
(adopted again if it comes back still running those not placed elsewhere);
scales each model's replica count with the autoscaler; and answers
`status()` for the gateway and `exaserve status`.

Decisions about *where* replicas go come from the planner's policies
(placement_control.py: placement.Placer, failover, rebalance, the invariant
audit), about *how many* from `Autoscaler.tick` (bounded by what can be
placed, capacity.placeable_replicas), about *which* to stop from
`pick_for_removal`: pure functions; the thread only carries them out. A
scale-down drains the replica in the router first (no new requests), then
asks its agent to stop it (it finishes what it holds, then exits); the record
goes once it reports stopped.

The state is a `Fleet` (fleet.py: agents, replicas, ids, the outbox of agent
messages) with a public interface; the parts that act on it live in their own
modules: placement (placement_control.py), rollouts (rollout_control.py),
load failover with L2 prefetch (weight_control.py) and the OOM guard's
evictions (oom_control.py), all run on the controller thread; and the
`status()` dict (status.py). `handle(agent_id, message)` and
`tick(now)` change the fleet and leave messages in its outbox; `take_effects()`
hands them over (nothing, once this controller is not surely the leader).
Callers hold `fleet.lock` around handle and tick (the loop and the simulator do).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc import metrics
from exaserve_hpc.agent.lifecycle import STOPPED_UNASKED, ReplicaState
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, HeartbeatAck, LoadFailed, ReplicaEvent, Shutdown, StageHello, StopReplica
)
from exaserve_hpc.router.port import RouterPort
from exaserve_hpc.controller.autoscale import HOLD, UP, AutoscalePolicy, Autoscaler, ScaleDecision
from exaserve_hpc.controller.capacity import placeable_replicas
from exaserve_hpc.controller.status import controller_status
from exaserve_hpc.controller.demand import DemandHistory
from exaserve_hpc.controller.fleet import Fleet, FleetSnapshot
from exaserve_hpc.controller.fleet_state import (  # noqa: F401 (re-exported)
    AgentRecord, ReplicaRecord, model_loads, pick_for_removal
)
from exaserve_hpc.controller.liveness import LOST, SUSPECT, Evidence, Lateness, adaptive_grace, judge
from exaserve_hpc.controller.oom_control import OomControl
from exaserve_hpc.controller.placement_control import PlacementControl, is_reservation_refusal
from exaserve_hpc.controller.rollout_control import RolloutFleet
from exaserve_hpc.controller.weight_control import WeightControl

log = logging.getLogger("exaserve.controller")

MAX_RESTARTS = 5  # same-node restarts of a failed replica; past this it goes to another node


class ControllerCore:
    def __init__(self, site: SiteConfig, router: RouterPort, clock: Callable[[], float] = time.monotonic,
                 expected_agents: Optional[list[str]] = None, placement_grace: float = 30.0,
                 demand_interval: float = 10.0, run_dir: Optional[Path] = None, endpoint: str = ""):
        """expected_agents: agent ids the bootstrap saw; placement waits for all of them (at most
        placement_grace seconds) so the first agent to say hello does not get every replica. demand_interval:
        seconds per sample of the demand history that the L2 prefetch forecast reads. run_dir: where moved
        replicas' KV snapshots go (shared storage; default the site's run_dir). endpoint: where agents and
        pipeline stages reach this controller ("" for a core nothing connects to)."""
        self.site = site
        self.router = router
        self.clock = clock
        self.endpoint = endpoint
        self.expected_agents = set(expected_agents or ())
        self._placement_opens = clock() + placement_grace
        self.lost_at: dict[str, float] = {}  # agent id -> clock() when declared lost (benchmarks read it)
        self.lateness: dict[str, Lateness] = {}  # agent id -> how late its heartbeats arrive (liveness.py)
        # agent id -> its agent process checked directly (True running, False gone, None cannot tell); set
        # by `exaserve serve`, whose agent is a child (app/agent_supervisor.py). None: no node can be checked.
        self.process_check: Optional[Callable[[str], Optional[bool]]] = None
        self.fleet = Fleet(site, router, run_dir)
        self.fleet.pipelines.rendezvous = self.endpoint  # where pipeline stages find each other (pipeline.py)
        self.started_at = time.time()
        self.restored = None  # controller_state.ControllerState this run started from (a requeued job)
        self.demand = DemandHistory([m.model_name for m in site.models])
        self.autoscaler = Autoscaler(AutoscalePolicy.from_site(site))
        self.decisions: dict[str, ScaleDecision] = {}  # model -> the autoscaler's latest decision
        self.last_scaling: dict[str, tuple[ScaleDecision, float]] = {}  # model -> (last up/down, wall time)
        self.bounded: dict[str, str] = {}  # model -> why the autoscaler's target was cut to what can be placed
        self.demand_interval = demand_interval
        self._next_demand_sample = 0.0
        self.on_replica_state: Optional[Callable[[ReplicaRecord], None]] = None
        self.placement = PlacementControl(self.fleet)  # where replicas go (placement_control.py)
        self.rollouts = RolloutFleet(self.fleet)  # model versions: what a rollout starts and stops
        self.fleet.model_dir = self.rollouts.model_dir
        self.weights = WeightControl(self.fleet, self.placement)  # load failover and L2 prefetch
        self.oom = OomControl(self.fleet, self.demand, demand_interval)  # evictions when device memory runs short
        # The HA gate (ha/election.py): False once this controller is not surely the leader. Then it decides
        # nothing and sends nothing (take_effects), so a deposed leader stops before a standby starts.
        self.acting: Callable[[], bool] = lambda: True
        self.ha_status: Optional[Callable[[], dict]] = None

    # the fleet's tables, for readers that knew them here
    @property
    def agents(self) -> dict[str, AgentRecord]:
        return self.fleet.agents

    @property
    def replicas(self) -> dict[str, ReplicaRecord]:
        return self.fleet.replicas

    # ---------------------------------------------------------------- lifecycle

    def stopping(self) -> None:
        """The job is stopping (from the stop signal on): a replica an agent stops is neither placed again
        nor moved, even before shutdown()'s order reaches the agents (they may get the signal too)."""
        with self.fleet.lock:
            self.placement.closing = True

    def shut_down_fleet(self, drain_timeout: float) -> None:
        """The job is ending (fleet lock held): every live agent drains and stops its replicas; a replica an
        agent stops from now on is neither placed again nor moved."""
        self.placement.closing = True
        self._broadcast(Shutdown(drain_timeout=drain_timeout))

    def restore(self, state) -> None:
        """Start from a controller_state.ControllerState (call before start()): its placement is preferred."""
        with self.fleet.lock:
            self.restored = state
            self.placement.preferred = {
                rid: node for rid, (model, node) in state.placement.items()
                if node and rid in self.replicas and self.replicas[rid].model == model}

    # ---------------------------------------------------------------- status

    def serving_count(self) -> int:
        """Replicas serving; 0 while the controller or router is not running (liveness()): /health is 503."""
        if self.liveness():
            return 0
        with self.fleet.lock:
            return sum(r.state is ReplicaState.SERVING for r in self.replicas.values())

    def status(self) -> dict:
        """The fleet as one JSON-ready dict for people (the gateway's /status, `exaserve status`), any thread."""
        status = controller_status(self)
        if self.ha_status is not None:  # an elected controller (ha/): who leads, since when, through which etcd
            status["ha"] = self.ha_status()
        return status

    def snapshot(self) -> FleetSnapshot:
        """The fleet as typed values for other components (state keeper, requeue watch), any thread."""
        with self.fleet.lock:
            return self.fleet.snapshot()

    def liveness(self) -> list[str]:
        """What keeps the service from working, for /health ([] when it works): the core's router stopped.
        The Controller adds its own thread's state."""
        return [] if self.router.routing() else ["router thread stopped"]  # RouterPort: in a group, every member

    def take_effects(self) -> list[tuple[str, object]]:
        """The messages handle and tick left for agents, [(agent_id, message)], in order; none while this
        controller is not surely the leader (ha/): a deposed leader's orders never reach an agent."""
        with self.fleet.lock:
            out = self.fleet.take_outbox()
        if not self.acting():
            return []
        for _, message in out:
            if not isinstance(message, HeartbeatAck):
                metrics.CONTROLLER_ORDERS.labels(type(message).__name__).inc()
        return out

    # ---------------------------------------------------------------- messages

    def handle(self, agent_id: str, message) -> None:
        """One message from an agent (fleet lock held); replies go to the fleet's outbox."""
        if not self.acting():
            return
        now = self.clock()
        fleet = self.fleet
        if isinstance(message, StageHello):  # a pipeline stage process looking for its peers (pipeline.py)
            fleet.send(agent_id, fleet.pipelines.on_hello(message))
            return
        if isinstance(message, AgentHello):
            log.info("agent %s joined from %s (pid %d, %d GPUs)", agent_id, message.hostname, message.pid,
                     len(message.gpus))
            fleet.join(AgentRecord.from_hello(agent_id, message, now))
            self._place(now)
            return
        agent = fleet.agents.get(agent_id)
        if agent is None:
            return  # a heartbeat from before our restart: the agent's hello will follow
        agent.last_seen = now
        if agent.silent_since and not agent.lost:
            log.warning("node %s heard again after %.1fs of silence: not lost", agent_id, now - agent.silent_since)
        agent.silent_since = 0.0
        if agent.lost:
            log.warning("agent %s is back after being declared lost", agent_id)
            agent.lost = False
        if isinstance(message, AgentHeartbeat):
            fleet.send(agent_id, HeartbeatAck(seq=message.seq))  # the agent's proof that we are alive
            self.lateness.setdefault(agent_id, Lateness(self.site.heartbeat.interval)).arrived(now)
            agent.on_heartbeat(message, now)
            for status in message.replicas:
                record = fleet.replicas.get(status.replica_id)
                if record is not None and record.agent_id == agent_id:
                    record.pid = status.pid
                    record.load_progress, record.load_source = status.load_progress, status.load_source
                    record.load_bytes_done, record.load_bytes_total = status.load_bytes_done, status.load_bytes_total
                elif record is not None and self._adoptable(record, agent_id, status):
                    self._adopt(record, agent_id, status)
                elif record is not None and not ReplicaState(status.state).terminal \
                        and self.placement.preferred.get(status.replica_id) != agent_id:
                    # (A replica the restored state places here is kept: a new leader, ha/, places it here.)
                    # An agent declared lost came back (a stall, not a death) while its replica was
                    # re-placed elsewhere: one copy must go, and it is the stale one.
                    log.warning("agent %s still runs replica %s, now placed on %s; stopping the stale copy",
                                agent_id, status.replica_id, record.agent_id)
                    fleet.send(agent_id, StopReplica(replica_id=status.replica_id, drain_timeout=5.0))
        elif isinstance(message, ReplicaEvent):
            self._on_replica_event(agent_id, message, now)
        elif isinstance(message, LoadFailed):
            self.weights.on_load_failed(agent_id, message)

    def _adoptable(self, record: ReplicaRecord, agent_id: str, status) -> bool:
        """The node that came back still runs `record`, which found no other home meanwhile."""
        lost = record.lost_assignment
        return (lost is not None and record.assignment is None and not record.stopping and lost.node == agent_id
                and not ReplicaState(status.state).terminal
                and all(n in self.agents and not self.agents[n].lost for n in lost.nodes))

    def _adopt(self, record: ReplicaRecord, agent_id: str, status) -> None:
        record.assignment, record.lost_assignment = record.lost_assignment, None
        record.agent_id, record.pid = agent_id, status.pid
        record.state = ReplicaState(status.state)
        record.tried_agents.discard(agent_id)
        record.detail = f"adopted: still running on {agent_id}, which came back"
        log.warning("replica %s adopted: %s came back still running it (not restarted)", record.replica_id,
                    agent_id)

    def _on_replica_event(self, agent_id: str, event: ReplicaEvent, now: float) -> None:
        if self.fleet.pipelines.on_stage_event(event):  # a later pipeline stage's process (pipeline.py)
            return
        record = self.replicas.get(event.replica_id)
        if record is None or record.agent_id != agent_id:
            return
        state = ReplicaState(event.state)
        if state is ReplicaState.STOPPED and event.detail.startswith(STOPPED_UNASKED) and not record.stopping:
            # Neither we nor its agent stopped it (the router dropped it after a stall, then told it to
            # drain): a failure to restart in place, not its node leaving.
            state = ReplicaState.FAILED
        record.state = state
        record.detail = event.detail
        record.transitions.append((state.value, event.seconds_in_previous_state))
        log.info("replica %s %s (%.2fs in previous state) %s", record.replica_id, state.value,
                 event.seconds_in_previous_state, event.detail)
        if record.stopping and state.terminal:
            self.fleet.forget(record, f"scaled down, {state.value}")
        elif state is ReplicaState.STOPPED:
            self.placement.left(record, event.detail)
        elif state is ReplicaState.SERVING:
            record.tried_agents.clear()
            record.failure = ""
        elif is_reservation_refusal(state, event.detail):
            self.placement.refused(record, event.detail)
        elif state is ReplicaState.FAILED:
            self.router.replica_lost(record.replica_id, f"process failed: {event.detail}")
            if record.restarts < MAX_RESTARTS:
                record.restarts += 1
                record.restart_at = now + min(30.0, 0.5 * 2 ** record.restarts)
                log.warning("replica %s failed (%s); restart %d/%d", record.replica_id, event.detail,
                            record.restarts, MAX_RESTARTS)
            else:
                self.placement.gave_up(record, record.restarts + 1, event.detail)
        if self.on_replica_state is not None:
            self.on_replica_state(record)

    def tick(self, now: float) -> None:
        """Periodic work (fleet lock held): lost nodes, restarts, autoscaling, rollouts, OOM guard,
        placement and rebalancing, demand samples and L2 prefetch."""
        if not self.acting():
            return
        self._judge_nodes(now)
        for record in self.replicas.values():
            if record.state is ReplicaState.FAILED and record.restart_at and now >= record.restart_at \
                    and record.agent_id and record.assignment is not None:
                record.restart_at = 0.0
                self.fleet.start(record)
        self._autoscale(now)
        self.rollouts.tick()
        self.oom.tick(now)
        self._place(now)
        self.placement.tick(now)
        if now >= self._next_demand_sample:
            self._next_demand_sample = now + self.demand_interval
            self.demand.observe(self.router.snapshot())
            self.weights.prefetch(now, self.demand, self.demand_interval)

    # ---------------------------------------------------------------- liveness (liveness.py)

    def _judge_nodes(self, now: float) -> None:
        """Suspect, clear or declare lost each node by liveness.judge, fed every channel we have."""
        expiry, base = self.site.heartbeat.expiry, self.site.heartbeat.loss_grace
        quiet = [a for a in self.agents.values() if not a.lost and now - a.last_seen > expiry]
        if not quiet:
            return
        replica_heard = self._replicas_heard(now)
        for agent in quiet:
            other = max((replica_heard.get(r.replica_id, 0.0) for r in self.replicas.values()
                         if r.agent_id == agent.agent_id), default=0.0)
            process = self.process_check(agent.agent_id) if self.process_check is not None else None
            lateness = self.lateness.get(agent.agent_id)
            grace = adaptive_grace(base, lateness.worst() if lateness else 0.0, expiry)
            verdict = judge(now, Evidence(agent.last_seen, other, process), expiry, grace)
            if verdict.state == SUSPECT and not agent.silent_since:  # a sign of life within the grace cancels it
                agent.silent_since = now
                log.warning("node %s %s; lost in %.1fs unless heard", agent.agent_id, verdict.why,
                            expiry + grace - verdict.silent)
            elif verdict.state == LOST:
                agent.lost = True
                self.lost_at[agent.agent_id] = now
                metrics.NODES_LOST.inc()
                log.error("node %s lost: %s (heartbeat %d x %.1fs)", agent.agent_id, verdict.why,
                          self.site.heartbeat.misses, self.site.heartbeat.interval)
                self.placement.node_lost(agent.agent_id)
            elif verdict.state not in (SUSPECT, LOST) and agent.silent_since:
                log.warning("node %s not lost: %s", agent.agent_id, verdict.why)
                agent.silent_since = 0.0

    def _replicas_heard(self, now: float) -> dict[str, float]:
        """replica id -> when the router last heard from it, on our clock (its snapshot's ages)."""
        try:
            silent = self.router.snapshot().get("replica_silent_s") or {}
        except Exception:  # a router without snapshots (tests' stand-ins): no second channel
            return {}
        return {rid: now - float(age) for rid, age in silent.items()}

    # ---------------------------------------------------------------- autoscaling

    def _autoscale(self, now: float) -> None:
        """One autoscaler tick: loads from the router's counters, decisions carried out at once."""
        snapshot = self.router.snapshot()
        routed = {r["replica_id"]: r for r in snapshot.get("replicas", [])}
        loads = model_loads(self.site, self.replicas.values(), routed, snapshot.get("pending_by_model", {}))
        for decision in self.autoscaler.tick(loads, now):
            self.decisions[decision.model] = decision
            if decision.direction == HOLD:
                log.debug("autoscale %s: %s", decision.model, decision.reason)
                continue
            log.info("autoscale %s: %s", decision.model, decision.reason)
            self.last_scaling[decision.model] = (decision, time.time())
            if decision.direction == UP:
                self._scale_up(decision)
            else:
                self._scale_down(decision, routed)

    def _scale_up(self, decision: ScaleDecision) -> None:
        """New records for the missing replicas, as many as can be placed now (capacity.placeable_replicas:
        the target never exceeds what fits); placement starts them. The decision counts serving replicas;
        the ones already starting count here, so a slow start adds no extras."""
        fleet = self.fleet
        active = fleet.active(decision.model)
        missing = decision.target - len(active)
        if missing <= 0 or not fleet.live_agents():
            return
        waiting = sum(r.assignment is None and not r.given_up for r in active)
        # Nodes closed for a while (OOM guard) count as room: a replica may wait for one to reopen.
        room, why = placeable_replicas(fleet.plan(), fleet.topology(), fleet.catalogue[decision.model], fleet.cap,
                                       missing + waiting)
        count = min(missing, max(0, room - waiting))
        if count < missing:
            self.bounded[decision.model] = (f"target {decision.target} cut to {len(active) + count}: "
                                            f"room for {max(0, room - waiting)} more ({why})")
            log.info("autoscale %s: %s", decision.model, self.bounded[decision.model])
        else:
            self.bounded.pop(decision.model, None)
        added = fleet.add(decision.model, count, f"added by autoscaler: {decision.reason}",
                          version=self.rollouts.stable(decision.model))
        if added:
            log.info("autoscale %s: adding %s", decision.model, ", ".join(r.replica_id for r in added))

    def _scale_down(self, decision: ScaleDecision, routed: dict[str, dict]) -> None:
        if self.placement.moving(decision.model):
            return  # a move holds one replica more for a while; the next decision after it counts
        active = self.rollouts.scalable(decision.model, self.fleet.active(decision.model))
        keep = max(decision.target, self.site.min_replicas(self.site.model(decision.model)))
        for rid in pick_for_removal(active, routed, len(active) - keep, self.fleet.group_of()):
            self.fleet.retire(self.replicas[rid], decision.reason)
        self.bounded.pop(decision.model, None)

    # ---------------------------------------------------------------- placement

    def _place(self, now: float) -> None:
        if self.expected_agents - set(self.agents) and now < self._placement_opens:
            return  # still waiting for agents the bootstrap announced
        self.placement.place()

    def _broadcast(self, message) -> None:
        for agent in self.fleet.live_agents():
            self.fleet.send(agent.agent_id, message)
