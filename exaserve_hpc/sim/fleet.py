"""The simulated nodes of the control plane (the routers are routers.py's).

`SimAgent` is one node: it answers StartReplica by reporting the replica loading, then serving after a
simulated load time (the replica then says hello to every router), and StopReplica by draining the replica
and reporting it stopped; it heartbeats while alive. A dead agent says nothing and its replicas vanish.
"""

from __future__ import annotations

from dataclasses import replace

from exaserve_hpc.engine.timing import GpuTimings
from exaserve_hpc.protocol import ReplicaBye, ReplicaEvent, ReplicaHello
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.sim.replica import SimReplica

REFERENCE_WEIGHT_BYTES = 16e9  # GpuTimings are for an 8B-parameter fp16 model on one GPU (engine/timing.py)
STEP_TOKENS = 8192  # prefill tokens per step across the batch (vLLM's max_num_batched_tokens default)


def scaled_timings(base: GpuTimings, spec: ModelSpec) -> GpuTimings:
    """The 8B/1-GPU constants scaled to a model's size and its GPUs (tensor/pipeline parallel split the work)."""
    size = (spec.weight_bytes or REFERENCE_WEIGHT_BYTES) / REFERENCE_WEIGHT_BYTES / spec.devices_per_replica
    kv = (spec.kv_bytes_per_token or base.kv_bytes_per_token) / base.kv_bytes_per_token / spec.devices_per_replica
    return replace(base, step_overhead_s=base.step_overhead_s * size, prefill_per_token_s=base.prefill_per_token_s * size,
                   decode_per_seq_s=base.decode_per_seq_s * size, prefill_per_pair_s=base.prefill_per_pair_s * kv,
                   kv_read_per_token_s=base.kv_read_per_token_s * kv)


class SimAgent:
    def __init__(self, node: str, sim):
        self.node = node
        self.sim = sim
        self.alive = True
        self.slow = 1.0
        self.seq = 0
        self.replicas: dict[str, SimReplica] = {}
        self.starting: dict[str, object] = {}  # replica id -> its StartReplica, until it serves

    def load_seconds(self, spec: ModelSpec) -> float:
        """Weights from the shared store at 2 GB/s per node, plus 20 s of engine start (a loaded L2 is not modelled)."""
        return 20.0 + (spec.weight_bytes or REFERENCE_WEIGHT_BYTES) / 2e9

    def on_start(self, msg, now: float) -> None:
        if not self.alive:
            return
        if msg.stage is not None and msg.stage.rank > 0:
            return  # a later pipeline stage: stage 0's process stands for the whole replica here
        spec = self.sim.catalogue[msg.model]
        self.sim.drop_copy(msg.replica_id)  # restarted elsewhere (a pipeline replica whose other stage's node died)
        self.starting[msg.replica_id] = msg
        self.sim.to_controller(now + 0.1, self.node, ReplicaEvent(agent_id=self.node, replica_id=msg.replica_id,
                                                                   state="loading"))
        # The run starts from a serving fleet (a warm start): the first placement loads in a second.
        load = 1.0 if now <= self.sim.warm_until else self.load_seconds(spec)
        self.sim.later(now + load, self.serve, msg.replica_id, msg)

    def serve(self, now: float, replica_id: str, msg) -> None:
        if not self.alive or self.starting.get(replica_id) is not msg:
            return  # the node died meanwhile, or the start was cancelled
        del self.starting[replica_id]
        spec = self.sim.catalogue[msg.model]
        kv_bytes = msg.memory_bytes * spec.devices_per_replica - (spec.weight_bytes or 0)  # every stage's GPUs
        replica = SimReplica(
            replica_id, msg.model, scaled_timings(self.sim.timings, spec), max_batch=spec.max_batch_size,
            kv_tokens=int(kv_bytes // max(1, spec.kv_bytes_per_token or 131072)),
            block_tokens=self.sim.block_tokens(msg.model), chunk_tokens=self.sim.site.batching.prefill_chunk_tokens,
            step_tokens=STEP_TOKENS, gpus=tuple((self.node, g) for g in msg.gpu_indices) or ((self.node, 0),),
            shared=self.sim.gpus, slow=self.slow, progress_every=self.sim.progress_every)
        if self.sim.router.follows_kv_events and self.sim._hasher is not None:
            replica.kv_log = []  # precise prefix routing: the routers follow its cache
        self.replicas[replica_id] = replica
        self.sim.replicas[replica_id] = replica
        self.sim.to_controller(now, self.node, ReplicaEvent(agent_id=self.node, replica_id=replica_id, state="serving"))
        self.sim.to_router(replica_id, ReplicaHello(replica_id=replica_id, model=msg.model, pid=1,
                                                    max_batch_size=spec.max_batch_size,
                                                    max_seq_len=spec.max_seq_len, node=self.node))

    def on_stop(self, msg, now: float) -> None:
        if not self.alive:
            return
        if self.starting.pop(msg.replica_id, None) is not None:
            self.sim.to_controller(now, self.node, ReplicaEvent(agent_id=self.node, replica_id=msg.replica_id,
                                                                 state="stopped", detail="stopped before serving"))
            return
        replica = self.replicas.get(msg.replica_id)
        if replica is not None:
            replica.draining_until = now + msg.drain_timeout
            self.check_drained(now, replica)

    def check_drained(self, now: float, replica: SimReplica) -> None:
        """A draining replica leaves once empty, or at its drain timeout (the router retries what it held)."""
        until = replica.draining_until
        if until is None or not replica.alive:
            return
        if replica.load() and now < until:
            self.sim.later(min(until, now + 1.0), lambda t: self.check_drained(t, replica))
            return
        replica.drop_all()
        self.replicas.pop(replica.replica_id, None)
        self.sim.replicas.pop(replica.replica_id, None)
        self.sim.to_router(replica.replica_id, ReplicaBye(replica_id=replica.replica_id, reason="drain"))
        self.sim.to_controller(now, self.node, ReplicaEvent(agent_id=self.node, replica_id=replica.replica_id,
                                                             state="stopped", detail="drained"))

    def die(self) -> int:
        """The node is gone: no heartbeat, no replica answers; returns the requests it held."""
        self.alive = False
        self.starting.clear()
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
