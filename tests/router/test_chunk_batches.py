"""Token chunks travel batched (protocol.TokenChunks): a replica sends one pass's chunks as one frame to
each router, and a router sends a gateway that asked for it (batch_replies) one frame per burst. Real echo
replica processes, a real router, DEALER sockets as gateways; and a replica's links to two routers."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.router_links import RouterLinks
from exaserve_hpc.protocol import (
    GenerateRequest, ReplicaHello, TokenChunk, TokenChunks, decode, encode,
)
from test_router_backpressure import start_echo, start_router, wait_for

pytestmark = pytest.mark.process


def stream_all(router, n: int, max_tokens: int, batch: bool) -> tuple[dict[str, list[int]], int, int]:
    """n requests at once from one gateway; each request's tokens as received, and the frames that carried
    one chunk and several."""
    gateway = router.context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(router.frontend_endpoint)
    ids = [uuid.uuid4().hex for _ in range(n)]
    for rid in ids:
        gateway.send(encode(GenerateRequest(request_id=rid, model="echo", prompt_token_ids=[256, 65, 66, 67],
                                            max_tokens=max_tokens, batch_replies=batch)))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    single = batched = 0
    deadline = time.monotonic() + 30
    while len(finished) < n and time.monotonic() < deadline:
        if not gateway.poll(200):
            continue
        frame = decode(gateway.recv())
        if isinstance(frame, TokenChunks):
            batched += 1
        else:
            single += 1
        for chunk in frame.chunks if isinstance(frame, TokenChunks) else [frame]:
            assert isinstance(chunk, TokenChunk), chunk
            assert chunk.request_id not in finished, "a chunk after its request's last"
            tokens[chunk.request_id] += chunk.token_ids
            if chunk.finished:
                finished.add(chunk.request_id)
    gateway.close()
    assert len(finished) == n, f"{n - len(finished)} streams did not finish"
    return tokens, single, batched


@pytest.fixture
def echo_router():
    router = start_router()
    replica = start_echo(router, "echo/r0")
    try:
        wait_for(lambda: len(router.snapshot()["replicas"]) == 1)
        yield router
    finally:
        replica.process.kill()
        replica.process.wait(10)
        router.stop()
        router.context.destroy(linger=0)


def test_a_replica_sends_a_steps_chunks_in_one_frame_and_a_batching_gateway_gets_them_in_one(echo_router):
    before = echo_router.messages_routed
    tokens, single, batched = stream_all(echo_router, n=16, max_tokens=200, batch=True)
    chunks = sum(len(t) for t in tokens.values())  # one token a chunk (no coalescing)
    assert all(len(t) == 200 for t in tokens.values())
    # every token as the echo engine makes it, in order: the same list for every stream of the same prompt
    assert len({tuple(t) for t in tokens.values()}) == 1
    frames_in = echo_router.messages_routed - before  # 16 requests, the replica's frames and its stats
    assert frames_in < chunks / 2, f"{frames_in} frames for {chunks} chunks: the replica did not batch"
    assert batched > 0 and single + batched < chunks / 2, (single, batched, chunks)


def test_a_gateway_that_did_not_ask_gets_one_chunk_a_frame(echo_router):
    tokens, single, batched = stream_all(echo_router, n=8, max_tokens=50, batch=False)
    assert batched == 0 and single == sum(len(t) for t in tokens.values()) == 8 * 50


def test_a_replicas_chunks_go_batched_to_the_router_that_sent_each_request():
    context = zmq.Context()
    routers = [context.socket(zmq.ROUTER) for _ in range(2)]
    endpoints = [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}" for sock in routers]
    links = RouterLinks(context, "m/r1", endpoints)
    try:
        links.broadcast(ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64))
        for sock in routers:
            assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()[1]), ReplicaHello)
        for k, rid in ((0, "a"), (1, "b"), (0, "c")):
            routers[k].send_multipart([b"m/r1", encode(GenerateRequest(request_id=rid, model="m",
                                                                       prompt_token_ids=[1], max_tokens=2))])
        got: list = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            if links.poll(100):
                got += list(links.receive(16))
        assert sorted(m.request_id for m in got) == ["a", "b", "c"]
        links.send_chunks([TokenChunk(request_id="a", token_ids=[1]), TokenChunk(request_id="b", token_ids=[2]),
                           TokenChunk(request_id="c", token_ids=[3], finished=True)])
        frames = [[decode(sock.recv_multipart()[1])] if sock.poll(2000) else [] for sock in routers]
        assert isinstance(frames[0][0], TokenChunks)
        assert [(c.request_id, c.token_ids) for c in frames[0][0].chunks] == [("a", [1]), ("c", [3])]
        assert isinstance(frames[1][0], TokenChunk) and frames[1][0].request_id == "b"
        assert not routers[0].poll(200) and not routers[1].poll(200), "one frame per router"
    finally:
        links.close()
        for sock in routers:
            sock.close(linger=0)
        context.destroy(linger=0)
