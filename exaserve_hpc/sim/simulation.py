"""Discrete-event simulation of the running control plane: the real controller core and router dispatcher.

One event heap in simulated seconds; nothing reads the wall clock, opens a socket or starts a thread.
- The controller is `controller.core.ControllerCore` (no socket, no thread) with the simulation's clock:
  agents' hellos, heartbeats and replica events go to its `handle`, its `tick` runs every
  `scheduler.tick_interval`, and its effects (StartReplica, StopReplica) go to the simulated nodes
  (fleet.py), each running the node agent's own core (agent/core.py) with simulated processes and weight
  loads. Placement, autoscaling, rebalancing, failover, the OOM guard's tick, scale-down choices and the
  agents' reservations and replica lifecycles are therefore the running code's.
- The routers are `router.dispatch.Dispatcher`s with the site's policy and settings, `router.count` of
  them (or `routers`) sharing the fleet as in a real job, each behind one thread that spends
  `router_cost` seconds of CPU per request, `router_chunk_cost` per token chunk a real replica would stream
  beyond the first and `router_stats_cost` per stats message (routers.py); requests go to one router as
  its gateway would send them (the prompt's block hashes precomputed in the router's scheme), its replies
  are delivered to the replicas (`SimReplica`, replica.py) or counted at the gateway; replicas report ReplicaStats to
  every router every router.replica_heartbeat, and the dispatchers' tick runs every second.
- Faults (workload.py) at their times; the controller finds a dead node by its missing heartbeats, the
  router by its replicas' missing stats, exactly as in a real run. When the controller's own node dies the
  requeue policy (`scheduler.requeue_policy`) is asked what rank 0 would do and its answer is recorded; the
  successor job is not simulated (the controller carries on).
After `duration` no request arrives; the run goes on until every accepted request has ended (at most
`drain_limit` simulated seconds more).
"""

from __future__ import annotations

import heapq
import logging
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.core import ControllerCore
from exaserve_hpc.controller.requeue_policy import RequeueSnapshot, requeue_decision
from exaserve_hpc.engine.timing import timings_for
from exaserve_hpc.protocol import Abort, GenerateRequest, ReplicaStats, RequestError, TokenChunk
from exaserve_hpc.router.dispatch import GATEWAY
from exaserve_hpc.router.dispatch_state import request_id_of
from exaserve_hpc.sim.fleet import SimAgent
from exaserve_hpc.sim.metrics import Recorder
from exaserve_hpc.sim.replica import SharedGpus, SimSeq
from exaserve_hpc.sim.routers import (
    CHUNK_COST_S, ROUTER_COST_S, STATS_COST_S, STATS_SLICES, SimRouters, simulated_request
)
from exaserve_hpc.sim.workload import Workload, arrivals


class Simulation:
    def __init__(self, site: SiteConfig, workload: Workload, duration: Optional[float] = None, seed: int = 0,
                 sample_every: Optional[float] = None, run_dir: Optional[Path] = None, drain_limit: float = 900.0,
                 on_progress: Optional[Callable[[float], None]] = None, static: bool = False, routers: int = 0,
                 router_cost: float = ROUTER_COST_S, router_pick: str = "round_robin",
                 router_chunk_cost: float = CHUNK_COST_S, router_stats_cost: float = STATS_COST_S):
        """static: replicas fixed at the site's plan (the autoscaler decides nothing; failover still re-places).
        routers: how many share the fleet (0: the site's router.count); router_cost: CPU-seconds a router's
        thread spends per request, router_chunk_cost per token chunk beyond the first, router_stats_cost per
        ReplicaStats message (routers.py); router_pick: how gateways are chosen (routers.PICKS)."""
        self.site, self.workload = site, workload
        self.duration = duration or workload.duration
        self.seed = seed
        self.drain_limit = drain_limit
        self.now = 0.0
        self._heap: list = []
        self._n = 0
        self.catalogue = catalogue_from_site(site)
        self.timings = timings_for(site.cluster.gpu_kind)
        self.gpus = SharedGpus()
        self.replicas: dict = {}  # replica id -> SimReplica serving (alive)
        self.models = {m.model_name for m in site.models}
        unknown = set(workload.models()) - self.models
        if unknown:
            raise ValueError(f"workload {workload.name} sends requests for {', '.join(sorted(unknown))}, which the "
                             f"site {site.site} does not serve; its models: {', '.join(sorted(self.models))}")
        self._block = {s.model: s.block_tokens for s in workload.streams}
        self._max_seq = {m: spec.max_seq_len for m, spec in self.catalogue.items()}
        self.too_long = 0  # requests longer than their model's max_seq_len, refused at the gateway
        self.router = SimRouters(site, self.models, lambda: self.now, routers, router_cost, router_pick, seed,
                                 router_chunk_cost, router_stats_cost)
        self.dispatcher = self.router.threads[0].dispatcher  # router 0's: its settings and hasher are all routers'
        # decoding replicas report progress well within the router's stall limit (real ones every ~20 ms)
        self.progress_every = min(10.0, self.dispatcher.settings.stall_limit / 4)
        hosts = site.cluster.hostnames()
        self.agents = {h: SimAgent(h, self) for h in hosts}
        self.ctl = ControllerCore(site, self.router, clock=lambda: self.now, expected_agents=hosts,
                              run_dir=run_dir)
        self.static = static
        self.warm_until = 1.0  # StartReplicas sent before this load in a second (the initial placement)
        if static:
            self.ctl.autoscaler.tick = lambda loads, now: []  # hold every model at its planned count
        self.controller_node = hosts[0]  # rank 0 runs on the first node of the allocation
        hasher = getattr(self.dispatcher.policy, "hasher", None)
        self._hasher = hasher if getattr(self.dispatcher.policy, "uses_prefix", False) else None
        self.rec = Recorder(sample_every or max(1.0, self.duration / 240))
        self.on_progress = on_progress
        self.requests: dict[str, tuple] = {}  # request id -> (workload Request, arrival, first token time)
        self.requeue: Optional[dict] = None
        self.wall_events = 0

    # ---------------------------------------------------------------- event plumbing

    def later(self, t: float, fn: Callable, *args) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def to_controller(self, t: float, agent: str, message) -> None:
        self.later(t, self._deliver_controller, agent, message)

    def _deliver_controller(self, now: float, agent: str, message) -> None:
        if self.agents[agent].alive:
            self.ctl.handle(agent, message)
            self._flush()

    def to_router(self, replica_id: str, message) -> None:
        """A hello or bye: to every router, as a replica's links broadcast it."""
        self._send(self.router.broadcast(replica_id, message, self.now))

    def drop_copy(self, replica_id: str) -> None:
        """A replica started again under its id: the old copy (if any still runs) goes."""
        old = self.replicas.pop(replica_id, None)
        if old is not None:
            old.drop_all()
            for agent in self.agents.values():
                if agent.replicas.get(replica_id) is old:
                    del agent.replicas[replica_id]

    def block_tokens(self, model: str) -> int:
        return self._block.get(model, 64)

    def _flush(self) -> None:
        """Carry out what the controller and router left to send."""
        for agent_id, message in self.ctl.take_effects():
            agent = self.agents.get(agent_id)
            if agent is None:
                continue
            agent.command(message, self.now)  # the node agent's core (agent/core.py) takes it
        if self.router.out:
            out, self.router.out = self.router.out, []
            self._send(out)

    def _send(self, out: list) -> None:
        now, rec = self.now, self.rec
        for o in out:
            m = o.message
            if o.side == GATEWAY:
                rid = m.request_id
                if isinstance(m, TokenChunk):
                    info = self.requests.get(rid)
                    if info is None:
                        continue
                    if info[2] < 0:
                        rec.first_token(now - info[1], info[0].model)
                        info[2] = now
                    if m.finished:
                        rec.done(now - info[1], info[0].model)
                        del self.requests[rid]
                elif isinstance(m, RequestError):
                    if self.requests.pop(rid, None) is not None:
                        rec.error(m.code)
                continue
            replica = self.replicas.get(o.peer.decode())
            if replica is None:
                continue  # a dead replica: the message is lost, as on a dead node
            if isinstance(m, GenerateRequest):
                info = self.requests.get(request_id_of(m.request_id))  # a resend carries its attempt's id
                blocks = info[0].blocks if info is not None else ()
                if replica.add(SimSeq(m.request_id, len(m.prompt_token_ids), m.max_tokens, blocks), now):
                    self.later(replica.busy_until, self._wake, replica, replica.version)
            elif isinstance(m, Abort):
                replica.abort(m.request_id)

    # ---------------------------------------------------------------- events

    def _wake(self, now: float, replica, version: int) -> None:
        if version != replica.version or not replica.alive:
            return  # rescheduled since, or dead
        out = []
        rid, requests = replica.replica_id, self.requests
        for kind, seq in replica.wake(now):
            info = requests.get(request_id_of(seq.request_id))
            if info is None:
                continue  # ended at the gateway already (its router would drop the late answer)
            thread, chunks = info[3], 0  # the answer goes to the router that sent the request
            if kind == "first":  # its handling is in the request's cost; the stream's further chunks are charged
                chunk = TokenChunk(request_id=seq.request_id, token_ids=[0], finished=seq.max_tokens <= 1,
                                   finish_reason="length" if seq.max_tokens <= 1 else None)
                chunks = self.router.chunks(seq.max_tokens - 1, replica.latency_ewma_ms)
            elif kind == "progress":
                chunk = TokenChunk(request_id=seq.request_id, token_ids=[0] * seq.progress)
            elif seq.max_tokens > 1:
                chunk = TokenChunk(request_id=seq.request_id, token_ids=[0] * (seq.max_tokens - seq.sent),
                                   finished=True, finish_reason="length")
            else:
                continue
            at = thread.answer(now, chunks)
            if at <= now:
                out += thread.dispatcher.on_replica_message(rid, chunk, now)
            else:  # behind the work its router's thread holds
                self.later(at, self._answered, thread, rid, chunk)
        if replica.kv_log:  # precise prefix routing: the engine's KV events, published as they happen
            hasher = self._hasher
            self.router.kv_events(rid, replica.kv_log, max(1, replica.block // hasher.block_size), hasher.block_size)
        if replica.busy:
            self.later(replica.busy_until, self._wake, replica, replica.version)
        if out:
            self._send(out)

    def _answered(self, now: float, thread, replica_id: str, chunk: TokenChunk) -> None:
        self._send(thread.dispatcher.on_replica_message(replica_id, chunk, now))

    def _arrive(self, now: float, it, request) -> None:
        nxt = next(it, None)
        if nxt is not None:
            self.later(nxt.arrival + self.t0, self._arrive, it, nxt)  # arrivals count from the start
        if request.prompt + request.max_tokens > self._max_seq[request.model]:
            self.too_long += 1  # the gateway refuses it (400) before the router sees it: not accepted
            return
        k = self.rec.arrivals
        self.rec.arrivals += 1
        rid = f"q{k}"
        thread = self.router.pick(request.blocks)
        self.requests[rid] = [request, now, -1.0, thread]
        req = simulated_request(rid, k, request.model, request.prompt, request.max_tokens, request.blocks,
                                request.block_tokens, self._hasher)
        if thread.cost <= 0:
            self._send(thread.dispatcher.on_request(thread.gateway, req, now))
        else:  # the router's thread takes it after those ahead of it
            self.later(thread.take(now), self._routed, thread, req)

    def _routed(self, now: float, thread, req: GenerateRequest) -> None:
        thread.held -= 1
        thread.routed += 1
        self._send(thread.dispatcher.on_request(thread.gateway, req, now))

    def _heartbeats(self, now: float) -> None:
        for agent in self.agents.values():
            if agent.alive:
                self.ctl.handle(agent.node, agent.heartbeat(now))
        self._flush()
        self.later(now + self.site.heartbeat.interval, self._heartbeats)

    def _controller_tick(self, now: float) -> None:
        self.ctl.tick(now)
        self._flush()
        if self.requeue is None and self.ctl.lost_at:
            snap = self.ctl.snapshot()
            decision = requeue_decision(RequeueSnapshot(len(self.agents), snap.live_nodes(), snap.lost_nodes(),
                                                        controller_node=self.controller_node))
            if decision.requeue:
                self.requeue = {"at": now, "reason": decision.reason.value, "exclude": list(decision.exclude),
                                "why": decision.why}
                self.rec.event(now, f"requeue decided: {decision.why} (successor job not simulated)")
        self.later(now + self.site.scheduler.tick_interval, self._controller_tick)

    def _router_tick(self, now: float) -> None:
        stats = []
        for rid, r in self.replicas.items():
            stats.append((rid, ReplicaStats(replica_id=rid, queue_depth=len(r.waiting),
                                            latency_ewma_ms=r.latency_ewma_ms,
                                            running=len(r.prefilling) + r.n_decoding, kv_used=r.used / r.kv_tokens,
                                            requests_finished=r.finished, prefix_hit_tokens=r.hit_tokens,
                                            prefix_query_tokens=r.query_tokens, kv_blocks_cached=len(r.cache))))
        out = []
        for rid, message in stats:  # every replica's stats reach every router
            out += self.router.broadcast(rid, message, now)
        hb, n = self.site.router.replica_heartbeat, len(stats)
        for k in range(STATS_SLICES):  # their CPU spread over the heartbeat, as real replicas' reports are
            self.later(now + k * hb / STATS_SLICES, self.router.stats_reached,
                       n * (k + 1) // STATS_SLICES - n * k // STATS_SLICES)
        out += self.router.tick(now)
        self._send(out)
        self.later(now + self.site.router.replica_heartbeat, self._router_tick)

    def _sample(self, now: float) -> None:
        serving: dict[str, int] = {m: 0 for m in sorted(self.models)}
        gpus = set()
        for r in self.ctl.replicas.values():
            if r.serving:
                serving[r.model] = serving.get(r.model, 0) + 1
            if r.assignment is not None:
                gpus.update((stage.node, g) for stage in r.assignment.stages for g in stage.gpus)
        queue = self.router.pending() + sum(len(r.waiting) for r in self.replicas.values())
        hit = sum(r.hit_tokens for r in self.replicas.values()) + self._gone_hits[0]
        query = sum(r.query_tokens for r in self.replicas.values()) + self._gone_hits[1]
        self.slot_sampled = self.gpus.slot_s
        self.rec.close(now, self.gpus.work_s, len(gpus), len(self.agents) * self.site.cluster.gpus_per_node, serving,
                       queue, self.router.inflight(), hit, query, sum(a.alive for a in self.agents.values()))
        self.router.sample(now, self.rec.interval)
        if self.on_progress is not None:
            self.on_progress(now)
        if now < self.duration or self.requests:
            self.later(now + self.rec.interval, self._sample)

    def _fault(self, now: float, fault) -> None:
        group_of = self.ctl.fleet.group_of()
        if fault.kind == "slow_node":
            self.agents[fault.node].set_slow(fault.factor)
            self.rec.event(now, f"node {fault.node} slowed x{fault.factor:g}")
            return
        if fault.kind == "node_loss":
            nodes = [fault.node]
        elif fault.kind == "controller_node_loss":
            nodes = [self.controller_node]
        else:
            nodes = sorted(n for n, g in group_of.items() if g == fault.group)
        if not nodes or any(n not in self.agents for n in nodes):
            raise ValueError(f"fault {fault.kind} at {fault.at:g}s names unknown nodes or group "
                             f"({fault.node or fault.group}); nodes: {', '.join(list(self.agents)[:4])}...")
        held = 0
        for n in nodes:
            for r in self.agents[n].replicas.values():
                self._gone_hits[0] += r.hit_tokens
                self._gone_hits[1] += r.query_tokens
            held += self.agents[n].die()
        what = {"node_loss": f"node {nodes[0]}", "controller_node_loss": f"the controller's node {nodes[0]}"}.get(
            fault.kind, f"fault group {fault.group} ({len(nodes)} nodes)")
        self.rec.event(now, f"{what} lost with {held} requests in flight")

    # ---------------------------------------------------------------- run

    def run(self) -> dict:
        """Run to the end; the control plane's loggers are quiet meanwhile (a lost node is a line per replica)."""
        quiet = [logging.getLogger(name) for name in ("exaserve", "exaserve_hpc")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.CRITICAL)
        try:
            return self._run()
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)

    def _run(self) -> dict:
        self._gone_hits = [0, 0]
        for h, agent in self.agents.items():
            self.ctl.handle(h, agent.hello(0.0))
        self._flush()
        # Requests start once the first placement serves: the run begins from a serving fleet (later starts
        # take the simulated L2 fill and engine start, sim/fleet.py); otherwise the autoscaler would scale the idle fleet down first.
        start = self.warm_until + 2.0
        self.t0 = start
        it = arrivals(self.workload, self.duration, seed=self.seed)
        first = next(it, None)
        if first is not None:
            self.later(first.arrival + start, self._arrive, it, first)
        for fault in self.workload.faults:
            self.later(start + fault.at, self._fault, fault)
        self.later(0.5, self._heartbeats)
        self.later(self.site.scheduler.tick_interval, self._controller_tick)
        self.later(self.site.router.replica_heartbeat, self._router_tick)
        self.later(start + self.rec.interval, self._sample)
        end = start + self.duration
        self.later(start, self.router.mark, "start")  # the routers' figures cover the arrivals' window
        self.later(end, self.router.mark, "end")
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            if t > end and not self.requests:
                break
            if t > end + self.drain_limit:
                break
            self.now = t
            fn(t, *args)
            self.wall_events += 1
        return self.summary()

    def summary(self) -> dict:
        rec, d = self.rec, self.router.counters()
        lost = rec.arrivals - rec.completed
        return {
            "site": self.site.site, "workload": self.workload.name, "duration_s": self.duration,
            "simulated_s": round(self.now - self.t0, 3), "requests": rec.arrivals, "accepted": d["accepted"],
            "completed": rec.completed, "failed": rec.failed, "lost": lost, "errors": dict(rec.errors),
            "retries": d["retries"], "ttft_p50_s": rec.ttft_all.quantile(0.5), "ttft_p99_s": rec.ttft_all.quantile(0.99),
            "e2e_p50_s": rec.e2e_all.quantile(0.5), "e2e_p99_s": rec.e2e_all.quantile(0.99),
            "ttft_mean_s": rec.ttft_all.mean, "gpu_util_allocated": rec.work_s / max(1e-9, rec.gpu_seconds_allocated),
            "gpu_seconds_allocated": rec.gpu_seconds_allocated, "gpu_work_seconds": rec.work_s,
            "gpu_batch_occupancy": getattr(self, "slot_sampled", 0.0) / max(1e-9, rec.gpu_seconds_allocated),
            "peak_qps": max((b.arrivals - a.arrivals) / rec.interval for a, b in zip(rec.samples, rec.samples[1:]))
            if len(rec.samples) > 1 else 0.0,
            "replicas_placed_max": max((sum(s.replicas.values()) for s in rec.samples), default=0),
            "refused_too_long": self.too_long, "requeue": self.requeue, "events": rec.events, "nodes_lost": sorted(self.ctl.lost_at),
            "slo": {"ttft_p99_s": self.workload.slo_ttft_p99, "e2e_p99_s": self.workload.slo_e2e_p99},
            "slo_held": (rec.ttft_all.quantile(0.99) <= self.workload.slo_ttft_p99
                         and rec.e2e_all.quantile(0.99) <= self.workload.slo_e2e_p99),  # latency; `lost` apart
            "static": self.static, "by_model": rec.by_model(),
            "prefix_hit_rate": rec.hit / rec.query if rec.query else 0.0,  # prompt tokens found cached, whole run
            "routers": self.router.summary(self.t0, self.t0 + self.duration),
        }

