"""The controller (rank 0): node agents in, replica commands out.

One thread owns a ROUTER socket that every node agent's DEALER connects to.
It records agent hellos, heartbeats and replica events; asks agents to start
the replicas the placement gives their node; restarts a failed replica (a
bounded number of times, with backoff); declares a node lost after
`heartbeat.misses` silent intervals and takes its replicas out of routing;
scales each model's replica count with the autoscaler; and answers
`status()` for the gateway and `exaserve status`.

Decisions about *where* replicas go come from `assign_replicas`, about *how
many* from `Autoscaler.tick`, about *which* to stop from `pick_for_removal`:
pure functions; the thread only carries them out. A scale-down drains the
replica in the router first (no new requests), then asks its agent to stop
it (it finishes what it holds, then exits); the record goes once it reports
stopped.

Parts of it live in their own modules: rollouts (rollout_control.py), load
failover with L2 prefetch (weight_control.py) and the OOM guard's evictions
(oom_control.py), all run on its thread; and the `status()` dict
(controller_status.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

import zmq

from ..agent.lifecycle import ReplicaState
from ..config import SiteConfig
from ..protocol import (
    AgentHeartbeat, AgentHello, DecodeError, EngineSettings, HeartbeatAck, LoadFailed, ReplicaEvent, Shutdown,
    StartReplica, StopReplica, decode, encode,
)
from ..router.zmq_router import ZmqRouter, bind
from .autoscale import HOLD, UP, Autoscaler, AutoscalePolicy, ScaleDecision
from .controller_status import controller_status
from .demand import DemandHistory
from .fleet_state import (  # noqa: F401 (AgentRecord, ReplicaRecord, assign_replicas re-exported)
    AgentRecord, ReplicaRecord, assign_replicas, desired_replicas, fresh_replica_ids, model_loads,
    pick_for_removal, unplaced_reason,
)
from .oom_control import OomControl
from .rollout_control import RolloutFleet
from .weight_control import WeightControl

log = logging.getLogger("exaserve.controller")

MAX_RESTARTS = 5


class Controller:
    def __init__(self, site: SiteConfig, router: ZmqRouter, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic, context: Optional[zmq.Context] = None,
                 curve=None, expected_agents: Optional[list[str]] = None, placement_grace: float = 30.0,
                 demand_interval: float = 10.0):
        """curve: bootstrap.CurveKeys to make the control socket a CURVE server that admits only the job's
        client key (None: plain TCP, the single-machine default). expected_agents: agent ids the bootstrap
        saw; placement waits for all of them (at most placement_grace seconds) so the first agent to say
        hello does not get every replica. demand_interval: seconds per sample of the demand history that
        the L2 prefetch forecast reads."""
        self.site = site
        self.router = router
        self.clock = clock
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._auth = None
        if curve is not None:
            from ..bootstrap import secure_server
            self._auth = secure_server(self.socket, curve, self.context)
        self.endpoint = bind(self.socket, host, port)
        self.expected_agents = set(expected_agents or ())
        self._placement_opens = clock() + placement_grace
        self.lost_at: dict[str, float] = {}  # agent id -> clock() when declared lost (benchmarks read it)
        self.agents: dict[str, AgentRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {
            rid: ReplicaRecord(rid, model) for rid, model in desired_replicas(site)}
        self.started_at = time.time()
        self.restored = None  # checkpoint.ControllerState this run started from (a requeued job)
        self.preferred: dict[str, str] = {}  # replica id -> node, from the restored placement
        self.demand = DemandHistory([m.model_name for m in site.models])
        self.autoscaler = Autoscaler(AutoscalePolicy.from_site(site))
        self.decisions: dict[str, ScaleDecision] = {}  # model -> the autoscaler's latest decision
        self.last_scaling: dict[str, tuple[ScaleDecision, float]] = {}  # model -> (last up/down, wall time)
        self._next_index = {m.model_name: site.initial_replicas(m) for m in site.models}  # ids never reused
        self.demand_interval = demand_interval
        self._next_demand_sample = 0.0
        self._commands: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._lock = threading.Lock()  # guards agents/replicas for status() readers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exaserve-controller", daemon=True)
        self.on_replica_state: Optional[Callable[[ReplicaRecord], None]] = None
        self.rollouts = RolloutFleet(self)  # model versions: what a rollout starts and stops (rollout_control.py)
        self.weights = WeightControl(self)  # load failover and L2 prefetch (weight_control.py)
        self.oom = OomControl(self)  # evictions when device memory runs short (oom_control.py)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "Controller":
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 10.0, wait: float = 20.0) -> None:
        """Tell every agent to drain and stop its replicas; wait until they all report stopped."""
        self._commands.put(lambda: self._broadcast(Shutdown(drain_timeout=drain_timeout)))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with self._lock:
                live = [r for r in self.replicas.values()
                        if r.agent_id and not r.state.terminal and r.state is not ReplicaState.PENDING]
            if not live:
                break
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()

    def restore(self, state) -> None:
        """Start from a checkpoint.ControllerState (call before start()): its placement is preferred."""
        with self._lock:
            self.restored = state
            self.preferred = {rid: node for rid, (model, node) in state.placement.items()
                              if node and rid in self.replicas and self.replicas[rid].model == model}

    # ---------------------------------------------------------------- status

    def serving_count(self) -> int:
        with self._lock:
            return sum(r.state is ReplicaState.SERVING for r in self.replicas.values())

    def status(self) -> dict:
        """The fleet as one JSON-ready dict, for any thread (controller_status.py)."""
        return controller_status(self)

    # ---------------------------------------------------------------- controller thread

    def _run(self) -> None:
        tick = self.site.scheduler.tick_interval
        next_tick = 0.0
        while not self._stop.is_set():
            if self.socket.poll(min(100, int(tick * 1000))):
                self._receive()
            while not self._commands.empty():
                self._commands.get_nowait()()
            now = self.clock()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + tick

    def _receive(self) -> None:
        for _ in range(1000):
            try:
                peer, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not two frames
            try:
                message = decode(frame)
            except DecodeError as exc:
                log.warning("undecodable message from agent %r: %s", peer[:32], exc)
                continue
            with self._lock:
                self._on_message(peer.decode(errors="replace"), message)

    def _on_message(self, agent_id: str, message) -> None:
        now = self.clock()
        if isinstance(message, AgentHello):
            log.info("agent %s joined from %s (pid %d, %d GPUs)", agent_id, message.hostname, message.pid,
                     len(message.gpus))
            self.agents[agent_id] = AgentRecord.from_hello(agent_id, message, now)
            self._place(now)
            return
        agent = self.agents.get(agent_id)
        if agent is None:
            return  # a heartbeat from before our restart: the agent's hello will follow
        agent.last_seen = now
        if agent.lost:
            log.warning("agent %s is back after being declared lost", agent_id)
            agent.lost = False
        if isinstance(message, AgentHeartbeat):
            self._send(agent_id, HeartbeatAck(seq=message.seq))  # the agent's proof that we are alive
            agent.on_heartbeat(message, now)
            for status in message.replicas:
                record = self.replicas.get(status.replica_id)
                if record is not None and record.agent_id == agent_id:
                    record.pid = status.pid
                    record.load_progress, record.load_source = status.load_progress, status.load_source
                    record.load_bytes_done, record.load_bytes_total = status.load_bytes_done, status.load_bytes_total
                elif record is not None and not ReplicaState(status.state).terminal:
                    # An agent declared lost came back (a stall, not a death) while its replica was
                    # re-placed elsewhere: one copy must go, and it is the stale one.
                    log.warning("agent %s still runs replica %s, now placed on %s; stopping the stale copy",
                                agent_id, status.replica_id, record.agent_id)
                    self._send(agent_id, StopReplica(replica_id=status.replica_id, drain_timeout=5.0))
        elif isinstance(message, ReplicaEvent):
            self._on_replica_event(agent_id, message, now)
        elif isinstance(message, LoadFailed):
            self.weights.on_load_failed(agent_id, message)

    def _on_replica_event(self, agent_id: str, event: ReplicaEvent, now: float) -> None:
        record = self.replicas.get(event.replica_id)
        if record is None or record.agent_id != agent_id:
            return
        state = ReplicaState(event.state)
        record.state = state
        record.detail = event.detail
        record.transitions.append((state.value, event.seconds_in_previous_state))
        log.info("replica %s %s (%.2fs in previous state) %s", record.replica_id, state.value,
                 event.seconds_in_previous_state, event.detail)
        if record.stopping and state.terminal:
            self._forget(record, f"scaled down, {state.value}")
            if self.on_replica_state is not None:
                self.on_replica_state(record)
            return
        if state is ReplicaState.SERVING:
            record.tried_agents.clear()
        if state is ReplicaState.FAILED:
            self.router.replica_lost(record.replica_id, f"process failed: {event.detail}")
            if record.restarts < MAX_RESTARTS:
                record.restarts += 1
                record.restart_at = now + min(30.0, 0.5 * 2 ** record.restarts)
                log.warning("replica %s failed (%s); restart %d/%d", record.replica_id, event.detail,
                            record.restarts, MAX_RESTARTS)
            else:
                log.error("replica %s failed %d times; giving up on it: %s", record.replica_id,
                          record.restarts + 1, event.detail)
        if self.on_replica_state is not None:
            self.on_replica_state(record)

    def _tick(self, now: float) -> None:
        with self._lock:
            expiry = self.site.heartbeat.expiry
            for agent in self.agents.values():
                if not agent.lost and now - agent.last_seen > expiry:
                    agent.lost = True
                    self.lost_at[agent.agent_id] = now
                    log.error("node %s lost: no heartbeat for %.1fs (%d x %.1fs)", agent.agent_id,
                              now - agent.last_seen, self.site.heartbeat.misses, self.site.heartbeat.interval)
                    for record in list(self.replicas.values()):
                        if record.agent_id == agent.agent_id:
                            self.router.replica_lost(record.replica_id, f"node {agent.agent_id} lost")
                            if record.stopping:  # it was leaving anyway: not re-placed
                                self._forget(record, f"scaled down, node {agent.agent_id} lost")
                                continue
                            record.agent_id = None
                            record.state = ReplicaState.PENDING
            for record in self.replicas.values():
                if record.state is ReplicaState.FAILED and record.restarts <= MAX_RESTARTS \
                        and record.restart_at and now >= record.restart_at and record.agent_id:
                    record.restart_at = 0.0
                    self._start(record)
            self._autoscale(now)
            self.rollouts.tick()
            self.oom.tick(now)
            self._place(now)
            if now >= self._next_demand_sample:
                self._next_demand_sample = now + self.demand_interval
                self.demand.observe(self.router.snapshot())
                self.weights.prefetch(now)

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

    def _active(self, model: str) -> list[ReplicaRecord]:
        return [r for r in self.replicas.values() if r.model == model and not r.stopping]

    def _scale_up(self, decision: ScaleDecision) -> None:
        """New records for the missing replicas; `_place` starts them where there is room. The decision
        counts serving replicas; the ones already starting count here, so a slow start adds no extras."""
        missing = decision.target - len(self._active(decision.model))
        rids = fresh_replica_ids(decision.model, self._next_index[decision.model], self.replicas, missing)
        for rid in rids:
            self.replicas[rid] = ReplicaRecord(rid, decision.model, version=self.rollouts.stable(decision.model),
                                               detail=f"added by autoscaler: {decision.reason}")
        if rids:
            self._next_index[decision.model] = int(rids[-1].rpartition("/r")[2]) + 1
            log.info("autoscale %s: adding %s", decision.model, ", ".join(rids))

    def _scale_down(self, decision: ScaleDecision, routed: dict[str, dict]) -> None:
        active = self.rollouts.scalable(decision.model, self._active(decision.model))
        keep = max(decision.target, self.site.min_replicas(self.site.model(decision.model)))
        for rid in pick_for_removal(active, routed, len(active) - keep):
            self._retire(self.replicas[rid], decision.reason)

    def _retire(self, record: ReplicaRecord, reason: str) -> None:
        """Stop one replica without failing a request: out of routing first, then drain and exit."""
        record.stopping = True
        record.detail = f"scaling down: {reason}"
        agent = self.agents.get(record.agent_id) if record.agent_id else None
        if agent is None or agent.lost or record.state.terminal:
            self._forget(record, "scaled down before it ran")  # no process to stop
            return
        log.info("autoscale: draining %s on %s", record.replica_id, record.agent_id)
        self.router.drain(record.replica_id)
        # The replica drains for its own drain_timeout; the agent kills it if that runs 5 s over.
        self._send(record.agent_id, StopReplica(replica_id=record.replica_id,
                                                drain_timeout=self._spec(record).drain_timeout))

    def _forget(self, record: ReplicaRecord, why: str) -> None:
        self.replicas.pop(record.replica_id, None)
        self.router.replica_lost(record.replica_id, why)  # a no-op once its ReplicaBye took it out
        log.info("replica %s forgotten: %s", record.replica_id, why)

    # ---------------------------------------------------------------- placement

    def _place(self, now: float) -> None:
        if self.expected_agents - set(self.agents) and now < self._placement_opens:
            return  # still waiting for agents the bootstrap announced
        live = [a.agent_id for a in self.agents.values() if not a.lost]
        closed = [a.agent_id for a in self.agents.values() if not a.lost and a.memory_closed]
        current = {rid: r.agent_id for rid, r in self.replicas.items()}
        max_per_node = self.site.scheduler.max_replicas_per_node
        wanted = assign_replicas([(rid, r.model) for rid, r in self.replicas.items()], live, current,
                                 max_per_node, self.preferred, closed)
        for rid, agent_id in wanted.items():
            record = self.replicas[rid]
            if agent_id is not None and record.agent_id is None:
                record.agent_id = agent_id
                self._start(record)
            elif agent_id is None and record.state is ReplicaState.PENDING:
                record.detail = unplaced_reason(len(live), max_per_node, len(closed))

    def _spec(self, record: ReplicaRecord) -> StartReplica:
        model = self.site.model(record.model)
        batching = self.site.batching
        settings = EngineSettings(
            engine=model.engine, max_batch_size=self.site.max_batch_size(model), max_seq_len=model.max_seq_len,
            max_wait_ms=batching.max_wait_ms, prefill_batch_size=batching.prefill_batch_size,
            decode_batch_size=batching.decode_batch_size, chunked_prefill=batching.chunked_prefill,
            prefill_chunk_tokens=batching.prefill_chunk_tokens, enable_prefix_caching=model.enable_prefix_caching,
            kv_cache_dtype=model.kv_cache_dtype)
        return StartReplica(replica_id=record.replica_id, model=record.model,
                            model_dir=self.rollouts.model_dir(record), version=record.version,
                            router_backend=self.router.backend_endpoint,
                            settings=settings, stats_interval=self.site.router.replica_heartbeat,
                            coalesce_ms=self.site.router.coalesce_ms,
                            coalesce_tokens=self.site.router.coalesce_tokens,
                            devices=model.tensor_parallel)  # tensor parallel stays on one node's devices

    def _start(self, record: ReplicaRecord) -> None:
        spec = self._spec(record)
        record.state = ReplicaState.PENDING
        record.detail = f"starting on {record.agent_id}"
        record.load_progress, record.load_bytes_done, record.load_bytes_total, record.load_source = 0.0, 0, 0, ""
        self._send(record.agent_id, spec)

    def _broadcast(self, message) -> None:
        for agent in self.agents.values():
            if not agent.lost:
                self._send(agent.agent_id, message)

    def _send(self, agent_id: str, message) -> None:
        try:
            self.socket.send_multipart([agent_id.encode(), encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cannot reach agent %s: %s", agent_id, exc)
