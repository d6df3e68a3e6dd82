"""A stream broken mid-way continues on another replica: the RouterClient sees one unbroken, correct stream.

Real replica processes running the reference engine (tiny model, greedy), so
the resumed continuation (re-prefill of prompt + tokens already sent) must be
token for token what an unbroken run produces.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.protocol import EngineSettings, GenerateRequest, StartReplica
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.router.balancing import PowerOfTwo
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process

MAX_TOKENS = 120
PROMPTS = [[256] + [65 + (i * 7 + j) % 50 for j in range(12 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", TinyModelSpec()))


def unbroken_answers(model_dir: str) -> list[list[int]]:
    engine = ReferenceEngine(model_dir, max_batch_size=8, max_seq_len=512, max_wait_ms=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.shutdown()
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def start_replica(router: ZmqRouter, replica_id: str, model_dir: str):
    spec = StartReplica(replica_id=replica_id, model="tiny", model_dir=model_dir,
                        router_backend=router.backend_endpoint,
                        settings=EngineSettings(engine="reference", max_batch_size=8, max_seq_len=512,
                                                max_wait_ms=0),
                        stats_interval=0.2)
    return spawn_replica(spec, "test-node")


def test_stream_killed_mid_way_continues_unbroken_through_the_router_client(model_dir):
    expected = unbroken_answers(model_dir)
    dispatcher = Dispatcher(PowerOfTwo(seed=0), DispatchSettings(max_attempts=3, first_token_timeout=20,
                                                                 replica_expiry=2.0, request_timeout=60), {"tiny"})
    router = ZmqRouter(dispatcher, context=zmq.Context()).start()
    replicas = [start_replica(router, f"tiny/r{i}", model_dir) for i in range(3)]
    by_id = {r.spec.replica_id: r for r in replicas}
    try:
        deadline = time.monotonic() + 60
        while len(router.snapshot()["replicas"]) < 3:
            assert time.monotonic() < deadline, "replicas did not register"
            time.sleep(0.05)
        client = RouterClient(router.frontend_endpoint, [ModelInfo("tiny", 512, 0)], reply_timeout=30)
        killed: list[str] = []

        async def one(i: int) -> tuple[list[int], set[str]]:
            tokens: list[int] = []
            served_by: set[str] = set()
            request = GenerateRequest(request_id=f"s{i}", model="tiny", prompt_token_ids=PROMPTS[i],
                                      max_tokens=MAX_TOKENS, temperature=0.0)
            async for chunk in client.stream(request):
                tokens += chunk.token_ids
                served_by.add(chunk.replica_id)
                assert chunk.completion_tokens == len(tokens)
                if i == 0 and not killed and len(tokens) >= 2 and not chunk.finished:
                    killed.append(chunk.replica_id)
                    os.kill(by_id[chunk.replica_id].process.pid, signal.SIGKILL)  # no goodbye
                if chunk.finished:
                    assert chunk.finish_reason == "length"
            return tokens, served_by

        async def run_all():
            try:
                return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            finally:
                await client.close()

        results = asyncio.run(asyncio.wait_for(run_all(), 90))
        assert killed
        tokens0, served0 = results[0]
        assert len(served0) == 2 and killed[0] in served0  # the broken stream moved to a second replica
        for (tokens, _), want in zip(results, expected):
            assert tokens == want  # one unbroken stream, token for token the uninterrupted answer
        assert router.snapshot()["failed"] == 0
    finally:
        router.stop()
        for r in replicas:
            if r.process.poll() is None:
                r.process.terminate()
            r.process.wait(10)
        router.context.destroy(linger=0)
