"""Aborts for clients that went away reach the replica promptly under load (issue 13 item 10).

Real pieces: echo replica processes (one token per 10 ms step, so a 512-token stream takes ~5 s), the
ZeroMQ router, and the gateway app over the router client on a real uvicorn server. While 60 streams
keep the gateway busy, 100 more clients (streaming, or not) hang up after their first bytes; the router
must have forgotten them (Abort sent to their replica) within a coalescing interval or so, and the
replicas must stop generating for them.

Non-streaming requests were the ones lost: the router client waited for each reply with asyncio.wait_for,
which (before Python 3.12) swallows a cancellation that meets a reply already queued, so the gateway's
cancel on a hang-up was lost and the request generated to its end (4.5 s here, most runs).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import EngineSettings, StartReplica
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.gateway.app import create_app
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process

COALESCE_S = 0.02


@pytest.fixture
def stack():
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(first_token_timeout=30, replica_expiry=10.0,
                                                           request_timeout=120), {"echo"})
    router = ZmqRouter(dispatcher, context=zmq.Context()).start()
    replicas = []
    for i in range(2):
        spec = StartReplica(replica_id=f"echo/r{i}", model="echo", model_dir="-",
                            router_backend=router.backend_endpoint,
                            settings=EngineSettings(engine="echo", max_batch_size=256, max_seq_len=4096,
                                                    options={"tokens_per_step": 1, "step_delay": 0.01}),
                            stats_interval=0.1, coalesce_ms=COALESCE_S * 1000)
        replicas.append(spawn_replica(spec, "test-node"))
    site = parse_site({"site": "aborts", "models": [{"model_name": "echo", "engine": "echo", "max_seq_len": 4096}],
                       "gateway": {"max_queued_requests": 4096}})
    client = RouterClient(router.frontend_endpoint, [ModelInfo("echo", 4096, created=0)],
                          ready=lambda: bool(router.snapshot()["replicas"]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(client, site), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and len(router.snapshot()["replicas"]) == 2):
        assert time.monotonic() < deadline, "the stack did not come up"
        time.sleep(0.05)
    yield router, sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    for replica in replicas:
        replica.process.kill()
        replica.process.wait(10)
    router.stop()
    router.context.destroy(linger=0)


async def post(port: int, body: dict, hang_up_after_bytes: bool) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    if hang_up_after_bytes:
        await reader.readuntil(b"\n\n")  # the head and, streaming, the first event
    else:
        await asyncio.sleep(1.0)  # non-streaming: nothing comes before the end; leave while it runs
    writer.transport.abort()  # gone at once, as a killed client is (RST, no goodbye)


async def scenario(router: ZmqRouter, port: int, stream: bool) -> dict:
    background = [asyncio.create_task(_read_all(port)) for _ in range(60)]
    await asyncio.sleep(1.0)
    gone = [post(port, {"model": "echo", "prompt": "abandoned", "max_tokens": 512, "stream": stream}, stream)
            for _ in range(100)]
    await asyncio.gather(*gone)
    hung_up = time.monotonic()
    # Only the 60 background streams may be left in flight once the aborts have landed.
    while router.snapshot()["inflight"] > 60 and time.monotonic() - hung_up < 10:
        await asyncio.sleep(0.005)
    forgotten_after = time.monotonic() - hung_up
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    return {"forgotten_after": forgotten_after}


async def _read_all(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps({"model": "echo", "prompt": "load", "max_tokens": 2000, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:
        while await reader.read(65536):
            pass
    finally:
        writer.close()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_clients_are_aborted_on_the_replica_promptly_under_load(stack, stream):
    router, port = stack
    result = asyncio.run(scenario(router, port, stream))
    # All 100 abandoned requests left the router's books (and their Aborts went to the replicas) quickly.
    assert result["forgotten_after"] < 0.5, result
    time.sleep(0.5)
    before = sum(r["tokens_generated"] for r in router.snapshot()["replicas"])
    time.sleep(1.0)
    after = sum(r["tokens_generated"] for r in router.snapshot()["replicas"])
    # One second at 100 tokens/s for the 60 streams still running: about 6,000 tokens; the 100 abandoned
    # streams, had they gone on, would add 10,000 more.
    assert after - before < 6000 * 1.5, (before, after)
