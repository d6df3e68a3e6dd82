"""Precise prefix mode end to end: a real replica process (reference engine, small KV pool) announces its
KV-event endpoint, the real router subscribes, and the router's prefix index follows what the engine
really stores and evicts. The router also keeps the engine's prefix-hit figures."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.cache.checkpoint import create_tiny_checkpoint
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import EngineSettings, GenerateRequest, RequestError, StartReplica, decode, encode
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.policies import policy_for_site
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process
BLOCK = 16


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not met in time")


def router_for(mode: str) -> ZmqRouter:
    site = parse_site({"site": "t", "models": [{"model_name": "m"}],
                       "router": {"policy": "prefix_affinity", "prefix_mode": mode, "block_size": BLOCK}})
    dispatcher = Dispatcher(policy_for_site(site.router, site.batching),
                            DispatchSettings(first_token_timeout=30, replica_expiry=5.0), {"m"})
    return ZmqRouter(dispatcher, context=zmq.Context()).start()


def complete(router: ZmqRouter, gateway, prompt: list[int], max_tokens: int = 4) -> None:
    rid = uuid.uuid4().hex
    gateway.send(encode(GenerateRequest(request_id=rid, model="m", prompt_token_ids=prompt, max_tokens=max_tokens)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if gateway.poll(100):
            message = decode(gateway.recv())
            assert not isinstance(message, RequestError), message
            if message.finished:
                return
    raise AssertionError("request did not finish")


def held(router: ZmqRouter, replica_id: str, prompt: list[int]) -> int:
    """Leading blocks of `prompt`, hashed the router's way, that its index says the replica holds."""
    def look(d):
        hashes = d.policy.routing_key(prompt).block_hashes
        return dict(d.policy.index.match(hashes)).get(replica_id, 0)
    return router.call(look).result(5)


@pytest.fixture
def checkpoint(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.mark.parametrize("mode", ["precise", "approximate"])
def test_the_router_index_follows_the_engines_stores_and_evictions(checkpoint, mode):
    router = router_for(mode)
    # 8 KV blocks of 16 tokens and one sequence at a time: a 124-token request needs the whole pool.
    spec = StartReplica(replica_id="m/r0", model="m", model_dir=str(checkpoint), router_backend=router.backend_endpoint,
                        stats_interval=0.1,
                        settings=EngineSettings(engine="reference", max_batch_size=1, max_seq_len=256, max_wait_ms=0,
                                                options={"num_kv_blocks": 8, "block_size": BLOCK}))
    slot = spawn_replica(spec, "test-node")
    gateway = router.context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    try:
        gateway.connect(router.frontend_endpoint)
        wait_for(lambda: router.snapshot()["replicas"], what="replica registered")
        a = [256] + [65 + i % 26 for i in range(47)]  # 3 full blocks
        complete(router, gateway, a)
        if mode == "approximate":  # the router records its own decision; the engine's events are not followed
            assert held(router, "m/r0", a) == 3 and router.call(lambda d: d.follows_kv_events).result(5) is False
            return
        wait_for(lambda: held(router, "m/r0", a) == 3, what="the engine's stored blocks in the router's index")
        complete(router, gateway, a)  # served from the prefix cache
        wait_for(lambda: router.snapshot()["replicas"][0]["prefix_hit_tokens"] >= 2 * BLOCK,
                 what="the replica's prefix hits in the router's snapshot")
        snap = router.snapshot()
        assert snap["prefix_hit_tokens"] >= 2 * BLOCK and snap["prefix_query_tokens"] >= 2 * len(a)
        assert snap["routing"].get("affinity") == 1  # the second request went by the engine's own events
        b = [256] + [97 + i % 26 for i in range(119)]  # 120 + 4 tokens: all 8 blocks, so a's are evicted
        complete(router, gateway, b)
        wait_for(lambda: held(router, "m/r0", a) == 0, what="the engine's evictions in the router's index")
        assert held(router, "m/r0", b) == len(b) // BLOCK
    finally:
        gateway.close()
        if slot.process.poll() is None:
            slot.process.terminate()
        slot.process.wait(20)
        router.stop()
        router.context.destroy(linger=0)
