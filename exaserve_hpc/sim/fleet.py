"""The simulated nodes of the control plane (the routers are routers.py's).

`SimAgent` is one node running the node agent's own core (agent/core.py: the same reservations from a
memory pool of the node's GPUs, the same lifecycle and reports, the same L2 bookkeeping per model), with
simulated edges: a weight loader that fills L2 from the shared store at `L3_BYTES_PER_S` per node, replica
"processes" that report initializing -> warming -> registering -> serving `ENGINE_START_S` after they start
(the replica then says hello to every router), drain on SIGTERM and exit. It heartbeats while alive; a
dead agent says nothing and its replicas vanish.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path
from typing import Optional

from exaserve_hpc.agent.core import AgentCore
from exaserve_hpc.agent.gpu_binding import GpuGrant, GrantedGpu
from exaserve_hpc.agent.memory_pool import MemoryPool
from exaserve_hpc.agent.replica_process import ReplicaSlot
from exaserve_hpc.agent.weight_loader import FillResult, Ticket
from exaserve_hpc.engine.gpu_specs import ARCHITECTURES, GPU_SPECS, GpuSpec, replica_roofline
from exaserve_hpc.engine.timing import GpuTimings
from exaserve_hpc.engine.trtllm_backend import step_token_budget
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello, GpuInfo, L2Status, ReplicaBye, ReplicaHello, StartReplica
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.sim.replica import SharedGpus, SimReplica

REFERENCE_WEIGHT_BYTES = 16e9  # GpuTimings are for an 8B-parameter fp16 model on one GPU (engine/timing.py)
L3_BYTES_PER_S = 2e9  # a node's read rate from the shared weight store into L2
ENGINE_START_S = 20.0  # a replica process from start to serving (L2 -> L1 copy, engine build, warm-up)
WARM_START_S = 0.5  # each of fill and start for the initial placement: the run begins from a serving fleet


def scaled_timings(base: GpuTimings, spec: ModelSpec, gpu: Optional[GpuSpec] = None) -> GpuTimings:
    """A replica's step costs. With the model's architecture and a datasheet GPU: the replica's own roofline
    (engine/gpu_specs.replica_roofline: attention from its FLOPs, tensor-parallel all-reduces, pipeline
    stages in series, the weights' and KV cache's dtypes; checked against published figures by
    benchmarks/calibrate_timing.py --published). Otherwise the 8B/1-GPU constants scaled by weight and K/V
    bytes over the replica's GPUs (a coarse fallback: it counts pipeline stages as tensor parallel)."""
    if spec.architecture is not None and gpu is not None:
        shape = ARCHITECTURES[spec.architecture]
        per_param = (spec.weight_bytes or shape.weight_bytes) / shape.params
        weights = "bf16" if per_param >= 1.5 else "fp8" if per_param >= 0.75 else "int4"
        return GpuTimings(**replica_roofline(gpu, shape, spec.tensor_parallel, spec.pipeline_parallel,
                                             weights=weights, kv_cache="fp8" if spec.kv_cache_dtype == "fp8" else "bf16"))
    size = (spec.weight_bytes or REFERENCE_WEIGHT_BYTES) / REFERENCE_WEIGHT_BYTES / spec.devices_per_replica
    kv = (spec.kv_bytes_per_token or base.kv_bytes_per_token) / base.kv_bytes_per_token / spec.devices_per_replica
    return replace(base, step_overhead_s=base.step_overhead_s * size, prefill_per_token_s=base.prefill_per_token_s * size,
                   decode_per_seq_s=base.decode_per_seq_s * size, prefill_per_pair_s=base.prefill_per_pair_s * kv,
                   kv_read_per_token_s=base.kv_read_per_token_s * kv)


def sim_replica(replica_id: str, spec: ModelSpec, batching, timings: GpuTimings, *, memory_bytes: int,
                block_tokens: int, gpus: tuple, shared: SharedGpus, slow: float = 1.0,
                progress_every: float = 10.0) -> SimReplica:
    """A simulated replica of ``spec`` as the site deploys it, on GPUs that reserve ``memory_bytes`` each:
    the model's batch size, the site's prefill chunk, the deployed engine's step budget
    (engine/trtllm_backend.step_token_budget), KV in what the reservation leaves beside the weights.
    The simulator's nodes and benchmarks/bench_router_trace.py both build their replicas here."""
    kv_bytes = memory_bytes * spec.devices_per_replica - (spec.weight_bytes or 0)  # every stage's GPUs
    return SimReplica(replica_id, spec.name, timings, max_batch=spec.max_batch_size,
                      kv_tokens=int(kv_bytes // max(1, spec.kv_bytes_per_token or 131072)),
                      block_tokens=block_tokens, chunk_tokens=batching.prefill_chunk_tokens,
                      step_tokens=step_token_budget(batching.prefill_chunk_tokens, spec.max_batch_size),
                      gpus=gpus, shared=shared, slow=slow, progress_every=progress_every)


class SimProcess:
    """A replica process in simulated time, as the core sees one (Popen's pid, poll, send_signal, kill, wait)."""

    def __init__(self, agent: "SimAgent", slot: ReplicaSlot, pid: int):
        self.agent, self.slot, self.pid = agent, slot, pid
        self.returncode = None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.returncode is None:
            self.agent.drain(self.slot)

    def kill(self) -> None:
        if self.returncode is None:
            self.agent.exited(self.slot, -signal.SIGKILL)


class SimProcesses:
    """The core's ReplicaProcesses: a spawned replica serves ENGINE_START_S later; its status lines are
    queued here until the core reads them."""

    def __init__(self, agent: "SimAgent"):
        self.agent = agent
        self.lines: dict[str, list[str]] = {}
        self.pids = 1000

    def spawn(self, slot: ReplicaSlot, node: str, weights_dir: str, source: str, env: dict[str, str]) -> None:
        self.pids += 1
        slot.process = SimProcess(self.agent, slot, self.pids)
        sim = self.agent.sim
        start = WARM_START_S if sim.now <= sim.warm_until else ENGINE_START_S
        sim.later(sim.now + start, self.agent.serve, slot)

    def write(self, slot: ReplicaSlot, *states: str) -> None:
        self.lines.setdefault(slot.replica_id, []).extend(f"{state} 0" for state in states)

    def read_status(self, slot: ReplicaSlot) -> list[str]:
        return self.lines.pop(slot.replica_id, [])

    def close(self, slot: ReplicaSlot) -> None:
        self.lines.pop(slot.replica_id, None)


class SimLoader:
    """The weight loader's interface (request, poll, progress, forget): one L2 entry per model and node,
    filled from the shared store at L3_BYTES_PER_S; replicas starting while it fills wait for it."""

    def __init__(self, agent: "SimAgent"):
        self.agent = agent
        self.ready: set[str] = set()
        self.waiters: dict[str, set[str]] = {}  # model -> replica ids (or PREFETCH) waiting for its fill
        self.done: list[FillResult] = []

    def nbytes(self, model: str) -> int:
        return int(self.agent.sim.catalogue[model].weight_bytes or REFERENCE_WEIGHT_BYTES)

    def request(self, model: str, model_dir: str, holder: str, now: float, timeout: float = 0.0) -> Ticket:
        if model in self.ready:
            return Ticket(model, Path(model), True, self.nbytes(model))
        if model not in self.waiters:
            self.waiters[model] = set()
            sim = self.agent.sim
            fill = WARM_START_S if now <= sim.warm_until else self.nbytes(model) / L3_BYTES_PER_S
            sim.later(now + fill, self._filled, model)
        self.waiters[model].add(holder)
        return Ticket(model, Path(model), False, self.nbytes(model))

    def _filled(self, now: float, model: str) -> None:
        if not self.agent.alive:
            return
        self.ready.add(model)
        self.done.append(FillResult(model, model, self.waiters.pop(model, set()), True, 1))
        self.agent.pump(now)

    def poll(self, now: float) -> list[FillResult]:
        done, self.done = self.done, []
        return done

    def progress(self, key: str) -> tuple[int, int]:
        return 0, self.nbytes(key)

    def forget(self, holder: str) -> None:
        for waiting in self.waiters.values():
            waiting.discard(holder)

    def close(self) -> None:
        pass


class SimCache:
    """The L2 cache's interface the core uses: entries are the loader's, pins are not modelled."""

    def __init__(self, loader: SimLoader):
        self.loader = loader

    def path(self, key: str) -> Path:
        return Path(key)

    def unpin(self, key: str, holder: str, now: float) -> None:
        pass

    def status(self, now: float) -> L2Status:
        used = sum(self.loader.nbytes(m) for m in self.loader.ready)
        return L2Status(capacity=max(used, 1), used=used, fills=len(self.loader.ready))


class SimAgent:
    def __init__(self, node: str, sim):
        self.node = node
        self.sim = sim
        self.alive = True
        self.slow = 1.0
        self.seq = 0
        self.replicas: dict[str, SimReplica] = {}
        cluster = sim.site.cluster
        gpus = max(1, cluster.gpus_per_node)
        grant = GpuGrant(tuple(GrantedGpu(str(i), f"GPU-{node}-{i}") for i in range(cluster.gpus_per_node)),
                         source="simulated")
        self.processes = SimProcesses(self)
        self.loader = SimLoader(self)
        self.core = AgentCore(node, node, pool=MemoryPool([cluster.gpu_memory] * gpus, 1 << 20,
                                                          [g.ident for g in grant.gpus] or None),
                              cache=SimCache(self.loader), loader=self.loader, grant=grant,
                              processes=self.processes, clock=lambda: sim.now)

    def hello(self, now: float) -> AgentHello:
        gpus = [GpuInfo(index=i, name=self.sim.site.cluster.gpu_kind, memory_total=self.sim.site.cluster.gpu_memory)
                for i in range(self.sim.site.cluster.gpus_per_node)]
        return self.core.hello(gpus, 1 << 40, pid=1)

    def heartbeat(self, now: float) -> AgentHeartbeat:
        self.pump(now)
        self.seq += 1
        return self.core.heartbeat(self.seq, [], 0)

    def command(self, message, now: float) -> None:
        """A message from the controller, as the node agent's loop hands it to its core."""
        if not self.alive:
            return
        if isinstance(message, StartReplica):
            if message.stage is not None and message.stage.rank > 0:
                return  # a later pipeline stage: stage 0's process stands for the whole replica here
            self.sim.drop_copy(message.replica_id)  # restarted elsewhere (a pipeline replica whose other
            #                                        stage's node died)
        self.core.handle(message)
        self.pump(now)

    def pump(self, now: float) -> None:
        """One round of the agent's loop: status lines, finished fills, exits; reports to the controller."""
        if not self.alive:
            return
        self.core.read_status()
        self.core.advance_loads()
        self.core.reap()
        for message in self.core.take_effects():
            self.sim.to_controller(now, self.node, message)

    def serve(self, now: float, slot: ReplicaSlot) -> None:
        """The replica process is up: it says hello to the routers and reports serving."""
        if not self.alive or slot.process is None or slot.process.returncode is not None:
            return  # the node died meanwhile, or the process was stopped before it served
        spec = self.sim.catalogue[slot.spec.model]
        msg = slot.spec
        replica = sim_replica(slot.replica_id, spec, self.sim.site.batching,
                              scaled_timings(self.sim.timings, spec, GPU_SPECS.get(self.sim.site.cluster.gpu_kind)),
                              memory_bytes=msg.memory_bytes, block_tokens=self.sim.block_tokens(msg.model),
                              gpus=tuple((self.node, g) for g in msg.gpu_indices) or ((self.node, 0),),
                              shared=self.sim.gpus, slow=self.slow, progress_every=self.sim.progress_every)
        if self.sim.router.follows_kv_events and self.sim._hasher is not None:
            replica.kv_log = []  # precise prefix routing: the routers follow its cache
        self.replicas[slot.replica_id] = replica
        self.sim.replicas[slot.replica_id] = replica
        self.processes.write(slot, "initializing", "warming", "registering", "serving")
        self.pump(now)
        self.sim.to_router(slot.replica_id, ReplicaHello(replica_id=slot.replica_id, model=msg.model, pid=slot.process.pid,
                                                         max_batch_size=spec.max_batch_size,
                                                         max_seq_len=spec.max_seq_len, node=self.node))

    def drain(self, slot: ReplicaSlot) -> None:
        """SIGTERM: a serving replica drains (until empty or its drain timeout), then exits 0."""
        replica = self.replicas.get(slot.replica_id)
        if replica is None:  # not serving yet: it exits at once
            self.exited(slot, 0)
            return
        self.processes.write(slot, "draining")
        replica.draining_until = max(self.sim.now, slot.stop_deadline - 5.0)  # the agent adds 5 s (core.stop)
        self.check_drained(self.sim.now, replica, slot)

    def check_drained(self, now: float, replica: SimReplica, slot: ReplicaSlot) -> None:
        """A draining replica leaves once empty, or at its drain timeout (the router retries what it held)."""
        until = replica.draining_until
        if until is None or not replica.alive or not self.alive:
            return
        if replica.load() and now < until:
            self.sim.later(min(until, now + 1.0), lambda t: self.check_drained(t, replica, slot))
            return
        self.exited(slot, 0)

    def exited(self, slot: ReplicaSlot, code: int) -> None:
        """The replica process ends: its requests go back to the router, which forgets it."""
        slot.process.returncode = code
        replica = self.replicas.pop(slot.replica_id, None)
        if replica is not None:
            replica.drop_all()
            if self.sim.replicas.get(slot.replica_id) is replica:
                self.sim.replicas.pop(slot.replica_id, None)
            self.sim.to_router(slot.replica_id, ReplicaBye(replica_id=slot.replica_id,
                                                           reason="drain" if code == 0 else "exit"))
        self.pump(self.sim.now)

    def die(self) -> int:
        """The node is gone: no heartbeat, no replica answers; returns the requests it held."""
        self.alive = False
        held = 0
        for rid, replica in self.replicas.items():
            held += len(replica.drop_all())
            self.sim.replicas.pop(rid, None)
        self.replicas.clear()
        return held

    def set_slow(self, factor: float) -> None:
        self.slow = factor
        for replica in self.replicas.values():
            replica.slow = factor
