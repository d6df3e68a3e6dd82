"""The gateway's RouterClient ends a stream the router leaves silent for reply_timeout with a 504, and only
such a stream: one timer for every stream (not one a chunk). Real ZeroMQ: a ROUTER socket plays the router."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from exaserve_hpc.protocol import GenerateRequest, TokenChunk, decode, encode
from exaserve_hpc.gateway.backend import BackendError, ModelInfo
from exaserve_hpc.gateway.router_client import RouterClient


def test_a_silent_stream_gets_a_504_and_a_talking_one_does_not():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    client = RouterClient(endpoint, [ModelInfo("m", 512, 0)], reply_timeout=0.6)

    async def talker() -> int:
        """Answers request "talk" with a chunk every 0.2 s for 1.6 s (past reply_timeout), then its end."""
        loop = asyncio.get_running_loop()
        peer = None
        deadline = loop.time() + 10
        while peer is None and loop.time() < deadline:
            if router.poll(0):
                frames = router.recv_multipart()
                if decode(frames[1]).request_id == "talk":
                    peer = frames[0]
            await asyncio.sleep(0.01)
        for k in range(8):
            router.send_multipart([peer, encode(TokenChunk(request_id="talk", token_ids=[k]))])
            await asyncio.sleep(0.2)
        router.send_multipart([peer, encode(TokenChunk(request_id="talk", token_ids=[9], finished=True))])
        return 9

    async def consume(rid: str) -> list[int]:
        tokens: list[int] = []
        async for chunk in client.stream(GenerateRequest(request_id=rid, model="m", prompt_token_ids=[1],
                                                         max_tokens=16)):
            tokens += chunk.token_ids
        return tokens

    async def main():
        started = time.monotonic()
        answering = asyncio.ensure_future(talker())
        talking = asyncio.ensure_future(consume("talk"))
        silent = asyncio.ensure_future(consume("silent"))
        with pytest.raises(BackendError) as refused:
            await asyncio.wait_for(silent, 5)  # fails, not hangs, if no 504 ever comes
        waited = time.monotonic() - started
        assert refused.value.status == 504 and refused.value.code == "router_timeout"
        assert 0.55 <= waited < 1.5, waited  # reply_timeout, then at most a quarter of it (the watch's period)
        sent = await answering
        assert await talking == [0, 1, 2, 3, 4, 5, 6, 7, 9] and sent == 9  # never silent for 0.6 s: no 504
        await client.close()

    try:
        asyncio.run(main())
    finally:
        router.close(linger=0)
        context.term()
