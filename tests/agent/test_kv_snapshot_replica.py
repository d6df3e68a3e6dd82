"""KV snapshot migration through real replica processes: replica A drains
with kv_snapshot_out, replica B starts with kv_snapshot_in, and B's first
request hits the prefix cache (seen in the ReplicaStats it sends the router)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint
from exaserve_hpc.engine.tokenizer import ByteTokenizer
from exaserve_hpc.protocol import (
    Drain, EngineSettings, GenerateRequest, ReplicaBye, ReplicaHello, ReplicaStats, StartReplica,
    TokenChunk, decode, encode,
)

SPEC = TinyModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48, max_position=256, shards=1)
TOK = ByteTokenizer()
SYSTEM = "You are a helpful assistant on a supercomputer. Answer briefly and precisely. "


def prompt(i: int) -> list[int]:
    return TOK.encode(SYSTEM + f"Question {i}: what is {i} squared?")


class FakeRouter:
    """The router backend socket; replicas connect to it as DEALERs."""

    def __init__(self):
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.messages: list = []

    def send(self, replica_id: str, message) -> None:
        self.socket.send_multipart([replica_id.encode(), encode(message)])

    def wait_for(self, predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket.poll(50):
                _, frame = self.socket.recv_multipart()
                message = decode(frame)
                self.messages.append(message)
                if predicate(message):
                    return message
        raise AssertionError(f"timed out; last messages {[type(m).__name__ for m in self.messages][-10:]}")

    def generate(self, replica_id: str, request_id: str, tokens: list[int]) -> list[int]:
        self.send(replica_id, GenerateRequest(request_id=request_id, model="tiny", prompt_token_ids=tokens,
                                              max_tokens=8))
        out: list[int] = []
        while True:
            chunk = self.wait_for(lambda m: isinstance(m, TokenChunk) and m.request_id == request_id)
            out += chunk.token_ids
            if chunk.finished:
                return out


def start_replica(router: FakeRouter, replica_id: str, model_dir, **fields) -> subprocess.Popen:
    spec = StartReplica(replica_id=replica_id, model="tiny", model_dir=str(model_dir),
                        router_backend=router.endpoint, stats_interval=0.1, drain_timeout=5.0,
                        settings=EngineSettings(engine="reference", max_batch_size=4, max_seq_len=256,
                                                max_wait_ms=0, kv_cache_dtype="fp16"), **fields)
    proc = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.agent.replica_main",
                             "--spec", encode(spec).hex()])
    router.wait_for(lambda m: isinstance(m, ReplicaHello) and m.replica_id == replica_id)
    return proc


@pytest.fixture
def router():
    r = FakeRouter()
    yield r
    r.socket.close()


def test_replacement_replica_hits_the_drained_replicas_prefix_cache(tmp_path, router):
    model_dir = create_tiny_checkpoint(tmp_path / "tiny", SPEC)
    snapshot = tmp_path / "shared" / "r0-kv.h5"
    snapshot.parent.mkdir()

    a = start_replica(router, "r0", model_dir, kv_snapshot_out=str(snapshot))
    try:
        for i in (0, 1):
            router.generate("r0", f"a{i}", prompt(i))
        want = router.generate("r0", "a7", prompt(7))
        router.send("r0", Drain(timeout=5.0))
        router.wait_for(lambda m: isinstance(m, ReplicaBye) and m.replica_id == "r0")
        assert a.wait(20) == 0
    finally:
        a.kill()
    assert snapshot.is_file()

    b = start_replica(router, "r1", model_dir, kv_snapshot_in=str(snapshot))
    try:
        # Loaded before it registered: its first stats already show the cached blocks, and no hits yet.
        first = router.wait_for(lambda m: isinstance(m, ReplicaStats) and m.replica_id == "r1")
        assert first.kv_blocks_cached > 0 and first.prefix_hit_tokens == 0
        assert router.generate("r1", "b7", prompt(7)) == want
        stats = router.wait_for(lambda m: isinstance(m, ReplicaStats) and m.replica_id == "r1"
                                and m.requests_finished == 1)
        assert stats.prefix_hit_tokens == (len(prompt(7)) - 1) // 16 * 16 > 0
        router.send("r1", Drain(timeout=5.0))
        assert b.wait(20) == 0
    finally:
        b.kill()


def test_a_damaged_snapshot_costs_only_the_cache(tmp_path, router):
    model_dir = create_tiny_checkpoint(tmp_path / "tiny", SPEC)
    damaged = tmp_path / "kv.h5"
    damaged.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)   # an HDF5 signature, then nothing
    c = start_replica(router, "r2", model_dir, kv_snapshot_in=str(damaged))
    try:
        assert router.generate("r2", "c0", prompt(0))
        stats = router.wait_for(lambda m: isinstance(m, ReplicaStats) and m.replica_id == "r2"
                                and m.requests_finished == 1)
        assert stats.prefix_hit_tokens == 0
        router.send("r2", Drain(timeout=5.0))
        assert c.wait(20) == 0
    finally:
        c.kill()
