"""A real NodeAgent (in a thread of the test process) driven through a fake controller socket.

The agent's replicas are real processes (children of the test process), so
tests can check that none outlives its failure.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from serve_harness import alive  # noqa: F401 (re-exported for the agent tests)

from exaserve_hpc.agent.gpu_binding import GpuGrant
from exaserve_hpc.agent.node_agent import NodeAgent
from exaserve_hpc.cache.checkpoint import TinyModelSpec
from exaserve_hpc.protocol import (
    AgentHeartbeat, EngineSettings, LoadFailed, ReplicaEvent, Shutdown, StartReplica, StopReplica, decode, encode,
)

TINY = TinyModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48, max_position=128, shards=2)


class AgentUnderTest:
    def __init__(self, tmp_path: Path, *, pool_bytes: int = 1 << 30, block_size: int = 1 << 20,
                 l2_capacity: int = 64 << 20, heartbeat: float = 0.2, **agent_options):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.router_backend = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        # No GPU unless a test grants some: this machine's CUDA_VISIBLE_DEVICES or Slurm variables
        # must not change the pool these tests expect.
        agent_options.setdefault("grant", GpuGrant())
        self.agent = NodeAgent(f"tcp://127.0.0.1:{port}", "node-t", heartbeat, l2_root=str(tmp_path / "l2"),
                               pool_bytes=pool_bytes, block_size=block_size, l2_capacity=l2_capacity,
                               **agent_options)
        self.messages: list = []
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        self.peer = self.wait_for(lambda m: True, timeout=60).agent_id.encode()

    # ------------------------------------------------------------ talking

    def send(self, message) -> None:
        self.socket.send_multipart([self.peer, encode(message)])

    def start(self, replica_id: str, model_dir: str, engine: str = "reference", **fields) -> None:
        self.send(StartReplica(replica_id=replica_id, model="tiny", model_dir=str(model_dir),
                               router_backend=self.router_backend,
                               settings=EngineSettings(engine=engine, max_batch_size=4, max_seq_len=64),
                               drain_timeout=2.0, **fields))

    def stop(self, replica_id: str) -> None:
        self.send(StopReplica(replica_id=replica_id, drain_timeout=2.0))

    def pump(self, timeout: float = 0.05) -> None:
        """Receive everything: the agent's messages and, on the fake router endpoint, the replicas' hellos."""
        while self.socket.poll(int(timeout * 1000)):
            _, frame = self.socket.recv_multipart()
            self.messages.append(decode(frame))
            timeout = 0.0

    def wait_for(self, predicate, timeout: float = 60.0, start: int = 0):
        deadline = time.monotonic() + timeout
        seen = start
        while time.monotonic() < deadline:
            self.pump()
            for message in self.messages[seen:]:
                if predicate(message):
                    return message
            seen = len(self.messages)
        raise AssertionError(f"timed out; got {[type(m).__name__ for m in self.messages][-20:]}")

    def wait_state(self, replica_id: str, state: str, timeout: float = 60.0) -> ReplicaEvent:
        return self.wait_for(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == replica_id
                             and m.state == state, timeout)

    def wait_terminal(self, replica_id: str, timeout: float = 60.0) -> ReplicaEvent:
        return self.wait_for(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == replica_id
                             and m.state in ("stopped", "failed"), timeout)

    def events(self, replica_id: str) -> list[ReplicaEvent]:
        return [m for m in self.messages if isinstance(m, ReplicaEvent) and m.replica_id == replica_id]

    def load_failures(self) -> list[LoadFailed]:
        return [m for m in self.messages if isinstance(m, LoadFailed)]

    def heartbeat(self, after: float = 0.0) -> AgentHeartbeat:
        """The first heartbeat composed after ``after`` seconds from now. The agent composes a beat in its loop
        and a heartbeat thread sends it (again, each interval, until the next is composed), so a beat received
        now may be older than the last event: one numbered past the next is certainly composed after now."""
        self.pump()
        start = len(self.messages)
        seen = max((m.seq for m in self.messages if isinstance(m, AgentHeartbeat)), default=0)
        time.sleep(after)
        return self.wait_for(lambda m: isinstance(m, AgentHeartbeat) and m.seq > seen + 1, start=start)

    def settle(self, predicate, timeout: float = 15.0) -> AgentHeartbeat:
        """Wait for a heartbeat satisfying ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            beat = self.heartbeat()
            if predicate(beat) or time.monotonic() > deadline:
                return beat

    def close(self) -> None:
        self.send(Shutdown(drain_timeout=2.0))
        self.thread.join(20)
        assert not self.thread.is_alive(), "the agent did not shut down"
        self.socket.close()
