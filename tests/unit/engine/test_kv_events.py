"""KV events reach a real ZeroMQ SUB socket: stored, evicted, cleared."""

import time

import pytest
import zmq

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.block_manager import prompt_block_hashes
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from exaserve_hpc.engine.kv_publisher import KVEventPublisher
from exaserve_hpc.engine.reference import ReferenceEngine

SPEC = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=48,
                     max_position=128, shards=1, seed=2)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC))


def subscribe(endpoint):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    time.sleep(0.3)  # PUB drops messages until the subscription has arrived
    return sub


def receive_all(sub, until, timeout_s=5.0):
    """Messages up to and including one whose events contain an ``until`` instance."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            batch = decode_batch(payload)
            got.append((topic, int.from_bytes(seq, "big"), batch))
            if any(isinstance(e, until) for e in batch.events):
                return got
    raise AssertionError(f"no {until.__name__} within {timeout_s}s; got {got}")


def test_engine_publishes_stored_evicted_and_cleared(loaded):
    engine = ReferenceEngine.from_weights(
        *loaded, max_wait_ms=0, max_seq_len=128, block_size=8, num_kv_blocks=8,
        kv_events_endpoint="tcp://127.0.0.1:*", replica_id="r7")
    sub = subscribe(engine.kv_events_endpoint)
    try:
        prompt = list(range(10, 30))  # 20 tokens: 2 full blocks
        engine.add_request(EngineRequest("a", prompt, 4, stop_token_ids=()))
        while engine.has_unfinished():
            engine.step()
        messages = receive_all(sub, BlockStored)
        topic, seq, batch = messages[0]
        assert topic == b"kv-events" and seq == 0 and batch.replica_id == "r7"
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored[0].block_hashes == prompt_block_hashes(prompt, 8)
        assert stored[0].parent_block_hash is None and stored[0].block_size == 8
        # A different 60-token prompt needs all 8 blocks: the cached ones are evicted.
        engine.add_request(EngineRequest("b", list(range(40, 100)), 2, stop_token_ids=()))
        while engine.has_unfinished():
            engine.step()
        messages = receive_all(sub, BlockRemoved)
        removed = [h for _, _, b in messages for e in b.events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes]
        assert set(prompt_block_hashes(prompt, 8)) <= set(removed)
        seqs = [s for _, s, _ in messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
        engine.shutdown()
        receive_all(sub, AllBlocksCleared)
    finally:
        engine.shutdown()
        sub.close()


def test_bind_failure_is_actionable():
    first = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match="cannot bind the KV-event socket on"):
            KVEventPublisher(first.endpoint)
    finally:
        first.close()
