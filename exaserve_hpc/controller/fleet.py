"""The fleet: node agents, replicas and replica ids, with the public interface the controller's parts use.

The controller's loop (loop.py) owns the thread and the socket; its parts (placement_control.py,
oom_control.py, rollout_control.py, weight_control.py, controller_status.py) read and change the fleet
only through this object, on the controller thread with `lock` held (`submit` queues work for that
thread from any other). Messages for agents go to `outbox`, which the controller's loop sends after each
handler, so the handlers run without sockets (tests and benchmarks drive them directly).

- `ReplicaIds` is the one way to make a replica id: `<model>/rNNNN`, numbered on from the site's initial
  replicas and past every id ever seen, never reused (logs and the router never confuse two replicas).
- `start(record, assignment)` sends the StartReplica the plan implies: stage 0's node, its device
  indices (`gpu_indices`) and the bytes reserved per device (`memory_bytes`: gpu_memory_utilization x the
  GPU's memory, or on a CPU node the model's weights + one max_seq_len sequence of KV, at least 256 MiB;
  catalogue.ModelSpec.reservation). A pipeline-parallel replica gets one StartReplica per stage, each to
  its stage's node (`stage_specs`, made stage processes by pipeline.PipelineStages).
- `retire(record, reason)` stops one replica without failing a request: out of routing first, then
  drained and stopped by its agent; the record goes once the agent reports it stopped.
- KV snapshots: every replica of a model whose engine keeps a prefix cache it can export writes its
  hottest blocks to `kv_snapshot_path(rid)` (in the run directory) when it drains; a replica that
  replaces it on a planned move starts from that file (`ReplicaRecord.kv_snapshot_in`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.registry import engine_settings, engine_spec
from exaserve_hpc.protocol import StartReplica, StopReplica
from exaserve_hpc.topology import Topology
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.fleet_state import AgentRecord, ReplicaRecord, desired_replicas
from exaserve_hpc.controller.live_placement import fleet_topology, held_plan
from exaserve_hpc.controller.stage_rendezvous import PipelineStages
from exaserve_hpc.controller.plan import Assignment, Plan, replica_id, replica_index

log = logging.getLogger("exaserve.controller")


def keeps_kv_snapshots(model) -> bool:
    """Whether a move of this model's replica can carry its prefix cache (engine/kv_snapshot.py)."""
    return engine_spec(model.engine).kv_snapshots and model.enable_prefix_caching and model.pipeline_parallel == 1


class ReplicaIds:
    """Next replica id per model; an id once used (or seen) is never given out again."""

    def __init__(self, site: SiteConfig):
        self._next = {m.model_name: site.initial_replicas(m) for m in site.models}

    def seen(self, rid: str) -> None:
        model = rid.rpartition("/r")[0]
        self._next[model] = max(self._next.get(model, 0), replica_index(rid) + 1)

    def fresh(self, model: str, count: int) -> list[str]:
        start = self._next.get(model, 0)
        self._next[model] = start + max(0, count)
        return [replica_id(model, start + k) for k in range(max(0, count))]


@dataclass(frozen=True)
class ReplicaView:
    """One replica as other components read it (a copy: safe outside the lock)."""
    replica_id: str
    model: str
    version: str
    state: ReplicaState
    node: Optional[str]
    nodes: tuple[str, ...]  # every stage's node
    gpus: tuple[int, ...]
    memory_bytes: int
    stopping: bool
    restarts: int
    detail: str


@dataclass(frozen=True)
class AgentView:
    agent_id: str
    lost: bool
    suspect: str
    memory_closed: str


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet between components (the state keeper, the requeue watch): typed, unlike status()'s JSON."""
    agents: tuple[AgentView, ...]
    replicas: tuple[ReplicaView, ...]

    def on_node(self, node: str) -> list[ReplicaView]:
        return [r for r in self.replicas if node in r.nodes]

    def live_nodes(self) -> tuple[str, ...]:
        return tuple(sorted(a.agent_id for a in self.agents if not a.lost))

    def lost_nodes(self) -> tuple[str, ...]:
        return tuple(sorted(a.agent_id for a in self.agents if a.lost))

    def placement(self) -> dict[str, tuple[str, str]]:
        """replica id -> (model, node) (node "" when not placed): what a restart needs to go back."""
        return {r.replica_id: (r.model, r.node or "") for r in self.replicas}


class Fleet:
    def __init__(self, site: SiteConfig, router, run_dir: Optional[Path] = None):
        self.site = site
        self.router = router
        self.catalogue = catalogue_from_site(site)
        self.cap = site.scheduler.max_replicas_per_node
        self.run_dir = Path(run_dir) if run_dir is not None else site.run_path
        self.agents: dict[str, AgentRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {rid: ReplicaRecord(rid, m) for rid, m in desired_replicas(site)}
        self.ids = ReplicaIds(site)
        self.lock = threading.Lock()  # guards agents/replicas for readers on other threads
        self.outbox: list[tuple[str, object]] = []  # (agent id, message), sent by the controller's loop
        self.commands: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self.model_dir: Callable[[ReplicaRecord], str] = lambda r: str(site.model_dir(site.model(r.model)))
        self._topology: Optional[Topology] = None  # built from the hellos on first use after a join
        self.keep_snapshots: set[str] = set()  # replica ids whose KV snapshot a moved replica starts from
        # Pipeline stages' attempts and rendezvous (pipeline.py); the controller sets its endpoint.
        self.pipelines = PipelineStages(timeout=site.heartbeat.expiry)

    # ---------------------------------------------------------------- reading

    def live_agents(self) -> list[AgentRecord]:
        return [a for a in self.agents.values() if not a.lost]

    def active(self, model: str) -> list[ReplicaRecord]:
        """A model's replicas that are not on their way out."""
        return [r for r in self.replicas.values() if r.model == model and not r.stopping]

    def topology(self) -> Topology:
        """The nodes whose agents said hello (lost ones included: placement counts them down)."""
        if self._topology is None:
            self._topology = fleet_topology(self.site, [a.inventory for a in self.agents.values()])
        return self._topology

    def join(self, record: AgentRecord) -> None:
        """An agent said hello (again: a restarted agent may report other devices): the topology follows."""
        self.agents[record.agent_id] = record
        self._topology = None

    def held(self) -> list[Assignment]:
        return [r.assignment for r in self.replicas.values() if r.assignment is not None]

    def down(self) -> set[str]:
        return {a.agent_id for a in self.agents.values() if a.lost}

    def plan(self) -> Plan:
        """What runs now, as the planner's Plan."""
        return held_plan(self.site.site, self.topology(), self.cap, self.held(), self.down())

    def group_of(self) -> dict[str, str]:
        return {n.name: n.fault_group for n in self.topology().nodes}

    def snapshot(self) -> FleetSnapshot:
        """A typed copy for other components (take the lock first when off the controller thread)."""
        return FleetSnapshot(
            tuple(AgentView(a.agent_id, a.lost, a.suspect, a.memory_closed) for a in self.agents.values()),
            tuple(ReplicaView(r.replica_id, r.model, r.version, r.state, r.agent_id,
                              r.assignment.nodes if r.assignment else (), r.assignment.gpus if r.assignment else (),
                              r.assignment.bytes_per_gpu if r.assignment else 0, r.stopping, r.restarts, r.detail)
                  for r in self.replicas.values()))

    # ---------------------------------------------------------------- changing

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` on the controller thread (from any thread)."""
        self.commands.put(work)

    def send(self, agent_id: str, message) -> None:
        self.outbox.append((agent_id, message))

    def take_outbox(self) -> list[tuple[str, object]]:
        out, self.outbox = self.outbox, []
        return out

    def add(self, model: str, count: int, detail: str, version: str = "") -> list[ReplicaRecord]:
        """`count` new records with fresh ids; placement starts them where there is room."""
        records = []
        for rid in self.ids.fresh(model, count):
            self.replicas[rid] = record = ReplicaRecord(rid, model, version=version, detail=detail)
            records.append(record)
        return records

    def kv_snapshot_path(self, rid: str) -> str:
        """Where replica `rid` writes its KV snapshot when it drains (shared storage: the run directory)."""
        return str(self.run_dir / "kv-snapshots" / f"{rid.replace('/', '.')}.h5")

    def discard_snapshot(self, rid: str) -> None:
        """Remove a snapshot nobody will read (a replica scaled down, or a move done): they add up."""
        self.keep_snapshots.discard(rid)
        try:
            Path(self.kv_snapshot_path(rid)).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("KV snapshot of %s not removed: %s", rid, exc)

    def stage_specs(self, record: ReplicaRecord) -> list[tuple[str, StartReplica]]:
        """(node, StartReplica) per pipeline stage of the record's assignment. Stage 0 registers with the
        router; later stages are the pipeline-parallel stage processes (started by their own agents)."""
        a = record.assignment
        assert a is not None, f"{record.replica_id} has no assignment"
        model = self.site.model(record.model)
        settings = engine_settings(self.site, model)
        snapshots = keeps_kv_snapshots(model)
        specs = []
        backends = self.router.backend_endpoints  # several routers: a replica links to each
        for k, stage in enumerate(a.stages):
            specs.append((stage.node, StartReplica(
                replica_id=record.replica_id, model=record.model, model_dir=self.model_dir(record),
                version=record.version, router_backend=self.router.backend_endpoint, settings=settings,
                router_backends=list(backends) if len(backends) > 1 else [],
                stats_interval=self.site.router.replica_heartbeat, coalesce_ms=self.site.router.coalesce_ms,
                coalesce_tokens=self.site.router.coalesce_tokens,
                devices=len(stage.gpus), gpu_indices=list(stage.gpus), memory_bytes=a.bytes_per_gpu,
                kv_snapshot_out=self.kv_snapshot_path(record.replica_id) if snapshots and k == 0 else "",
                kv_snapshot_in=record.kv_snapshot_in if snapshots and k == 0 else "")))
        return specs

    def spec(self, record: ReplicaRecord) -> StartReplica:
        """Stage 0's StartReplica (the one that registers with the router)."""
        return self.stage_specs(record)[0][1]

    def start(self, record: ReplicaRecord, assignment: Optional[Assignment] = None) -> None:
        """Start `record` where `assignment` (or its current one) puts it."""
        if assignment is not None:
            record.assignment = assignment
        record.lost_assignment = None  # placed again: a copy on a node that comes back is the stale one
        record.agent_id = record.assignment.node
        record.state = ReplicaState.PENDING
        record.detail = f"starting on {record.agent_id}"
        record.load_progress, record.load_bytes_done, record.load_bytes_total, record.load_source = 0.0, 0, 0, ""
        if record.kv_snapshot_in:
            Path(record.kv_snapshot_in).parent.mkdir(parents=True, exist_ok=True)
        stages = self.stage_specs(record)
        if stages[0][1].kv_snapshot_out:
            Path(stages[0][1].kv_snapshot_out).parent.mkdir(parents=True, exist_ok=True)
        for node, spec in self.pipelines.stage_starts(stages):  # one StartReplica per stage (pipeline.py)
            self.send(node, spec)

    def unplace(self, record: ReplicaRecord, why: str, avoid: Iterable[str] = ()) -> None:
        """Back to pending, its reservation released, `avoid` added to the nodes it must not go to."""
        record.tried_agents.update(avoid)
        record.assignment = None
        record.agent_id = None
        record.state = ReplicaState.PENDING
        record.restart_at = 0.0
        record.detail = why

    def retire(self, record: ReplicaRecord, reason: str) -> None:
        """Stop one replica without failing a request: out of routing first, then drain and exit."""
        record.stopping = True
        record.detail = f"scaling down: {reason}"
        agent = self.agents.get(record.agent_id) if record.agent_id else None
        if agent is None or agent.lost or record.state.terminal or record.assignment is None:
            self.forget(record, "scaled down before it ran")  # no process to stop
            return
        log.info("draining %s on %s: %s", record.replica_id, record.agent_id, reason)
        self.router.drain(record.replica_id)
        # The replica drains for its own drain_timeout; the agent kills it if that runs 5 s over.
        self.send(record.agent_id, StopReplica(replica_id=record.replica_id,
                                            drain_timeout=self.spec(record).drain_timeout))

    def forget(self, record: ReplicaRecord, why: str) -> None:
        self.replicas.pop(record.replica_id, None)
        self.pipelines.forget(record.replica_id)
        if record.replica_id not in self.keep_snapshots:  # a move's new replica still has to read it
            self.discard_snapshot(record.replica_id)
        self.router.replica_lost(record.replica_id, why)  # a no-op once its ReplicaBye took it out
        log.info("replica %s forgotten: %s", record.replica_id, why)
