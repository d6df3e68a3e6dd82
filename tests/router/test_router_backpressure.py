"""Backpressure towards a gateway that is not reading (issue 13 item 7): real echo replica processes flood the
router while the gateway's socket sits full; no token chunk may be dropped, and when the router's backlog
bound is reached one request is failed cleanly (an error, its replica told to abort), never left waiting.

The gateway is a DEALER socket with a tiny receive buffer that stops reading for a while, as a gateway
whose event loop is behind does; the router's per-connection high-water mark is set low so the pipe fills.
"""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.protocol import (
    EngineSettings, GenerateRequest, RequestError, StartReplica, TokenChunk, TokenChunks, decode, encode,
)
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process


def start_router(**kw) -> ZmqRouter:
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(max_attempts=3, first_token_timeout=30,
                                                           replica_expiry=10.0, request_timeout=120), {"echo"})
    return ZmqRouter(dispatcher, context=zmq.Context(), gateway_hwm=50, **kw).start()


def start_echo(router: ZmqRouter, replica_id: str, step_delay: float = 0.0):
    # One token per chunk, no coalescing: as many messages as tokens.
    spec = StartReplica(replica_id=replica_id, model="echo", model_dir="-", router_backend=router.backend_endpoint,
                        settings=EngineSettings(engine="echo", max_batch_size=256, max_seq_len=4096,
                                                options={"tokens_per_step": 1, "step_delay": step_delay}),
                        stats_interval=0.2, coalesce_ms=0.0, coalesce_tokens=1)
    return spawn_replica(spec, "test-node")


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def flood(router: ZmqRouter, n: int, max_tokens: int, pause: float, batch: bool = False) -> dict:
    """n requests from a gateway that reads nothing for `pause` seconds, then everything; what it got.
    batch: the requests say batch_replies (as the gateway's RouterClient's do): replies may come as TokenChunks."""
    gateway = router.context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.RCVHWM, 10)
    gateway.setsockopt(zmq.RCVBUF, 4096)  # before connect: the kernel buffer stays small as well
    gateway.connect(router.frontend_endpoint)
    ids = [uuid.uuid4().hex for _ in range(n)]
    for rid in ids:
        gateway.send(encode(GenerateRequest(request_id=rid, model="echo", prompt_token_ids=[256, 65, 66, 67],
                                            max_tokens=max_tokens, batch_replies=batch)))
    time.sleep(pause)  # the replicas go on generating; the router's pipe to us fills
    got = {rid: {"tokens": 0, "finished": False, "error": None} for rid in ids}
    deadline = time.monotonic() + 60
    batched_frames = 0
    while not all(g["finished"] or g["error"] for g in got.values()) and time.monotonic() < deadline:
        if not gateway.poll(200):
            continue
        frame = decode(gateway.recv())
        if isinstance(frame, TokenChunks):
            assert batch, "TokenChunks to a gateway that did not ask for them"
            batched_frames += 1
        for message in frame.chunks if isinstance(frame, TokenChunks) else [frame]:
            entry = got[message.request_id]
            assert not entry["finished"] and not entry["error"], f"a reply after the end of {message.request_id}"
            if isinstance(message, RequestError):
                entry["error"] = message
            else:
                assert isinstance(message, TokenChunk)
                entry["tokens"] += len(message.token_ids)
                entry["finished"] = message.finished
    gateway.close(linger=0)
    if batch:
        assert batched_frames > 0, "no TokenChunks came: nothing batched was tested"
    return got


@pytest.fixture
def replicas():
    started = []
    yield started
    for replica in started:
        replica.process.kill()
        replica.process.wait(10)


@pytest.mark.parametrize("batch", [False, True], ids=["chunk-a-frame", "batched"])
def test_a_gateway_that_falls_behind_loses_no_chunk(replicas, batch):
    router = start_router()
    try:
        replicas += [start_echo(router, f"echo/r{i}") for i in range(2)]
        wait_for(lambda: len(router.snapshot()["replicas"]) == 2)
        got = flood(router, n=40, max_tokens=1500, pause=3.0, batch=batch)
        assert router.backlog_counters["backlogged"] > 0, "the gateway's pipe never filled: nothing was tested"
        incomplete = {rid: g for rid, g in got.items() if not g["finished"] or g["tokens"] != 1500}
        assert not incomplete, f"{len(incomplete)} streams lost chunks or their end: {list(incomplete.values())[:3]}"
        assert router.backlog_counters["failed_for_backlog"] == 0
        wait_for(lambda: router.snapshot()["gateway_backlog"]["waiting"] == 0, timeout=2)
        assert router.snapshot()["gateway_backlog"]["backlogged"] == router.backlog_counters["backlogged"]
    finally:
        router.stop()
        router.context.destroy(linger=0)


def test_past_the_backlog_bound_one_request_fails_cleanly_and_its_replica_stops(replicas):
    router = start_router(gateway_backlog=2000)
    try:
        # 0.5 ms a step: 3,000 steps take the replica at least 1.5 s, so the requests the router fails (as soon
        # as 2,000 replies wait, a few hundred steps in) are still running when their aborts arrive; an
        # unpaced replica can finish all 20 before a router slowed by a busy machine fails the first
        replicas += [start_echo(router, "echo/r0", step_delay=0.0005)]
        wait_for(lambda: len(router.snapshot()["replicas"]) == 1)
        got = flood(router, n=20, max_tokens=3000, pause=3.0)
        failed = {rid: g for rid, g in got.items() if g["error"] is not None}
        assert failed and router.backlog_counters["failed_for_backlog"] == len(failed)
        for g in failed.values():
            assert g["error"].status == 503 and g["error"].code == "gateway_backlog" and g["error"].retry_after > 0
        assert all(g["finished"] and g["tokens"] == 3000 for rid, g in got.items() if rid not in failed)
        # the failed requests were aborted on the replica: it generated less than every request in full
        wait_for(lambda: router.snapshot()["inflight"] == 0, timeout=5)
        generated = sum(r["tokens_generated"] for r in router.snapshot()["replicas"])
        assert generated < 20 * 3000, generated
    finally:
        router.stop()
        router.context.destroy(linger=0)
