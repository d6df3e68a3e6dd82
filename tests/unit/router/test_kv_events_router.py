"""Precise mode over ZeroMQ: the router follows a replica's KV-event publisher and routes by it."""

from __future__ import annotations

import time

import zmq

from exaserve_hpc.engine.block_manager import prompt_block_hashes
from exaserve_hpc.engine.kv_events import BlockStored
from exaserve_hpc.engine.kv_publisher import KVEventPublisher
from exaserve_hpc.protocol import ReplicaHello, encode
from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_router_mirrors_kv_events_and_forgets_on_a_sequence_gap():
    policy = PrefixAffinity(AffinitySettings(mode="precise", block_size=4))
    router = ZmqRouter(Dispatcher(policy, DispatchSettings(replica_expiry=60), {"m"}), context=zmq.Context()).start()
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replica_id="r1")
    replica = router.context.socket(zmq.DEALER)
    replica.setsockopt(zmq.IDENTITY, b"r1")
    replica.setsockopt(zmq.LINGER, 0)
    try:
        replica.connect(router.backend_endpoint)
        replica.send(encode(ReplicaHello(replica_id="r1", model="m", pid=1, max_batch_size=8, max_seq_len=512,
                                         kv_events_endpoint=publisher.endpoint)))
        tokens = list(range(100, 116))
        hashes = prompt_block_hashes(tokens, 4)
        stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=4)

        def depth() -> int:
            found = router.call(lambda d: d.policy.index.match(hashes)).result(2)
            return dict(found).get("r1", 0)

        # PUB/SUB joins late: publish until the router has seen it.
        assert wait_for(lambda: (publisher.publish([stored]), depth() == 4)[1])
        publisher._seq += 5  # five batches lost on the way
        other = prompt_block_hashes(list(range(200, 204)), 4)
        publisher.publish([BlockStored(block_hashes=other, parent_block_hash=None, token_ids=list(range(200, 204)),
                                       block_size=4)])
        assert wait_for(lambda: depth() == 0)  # the gap made the router drop what it knew
        assert router.call(lambda d: dict(d.policy.index.match(other))).result(2) == {"r1": 1}
    finally:
        publisher.close()
        replica.close(0)
        router.stop()
        router.context.destroy(linger=0)
