"""The ZeroMQ router with real replica processes: a replica killed mid-stream costs no request."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.protocol import EngineSettings, GenerateRequest, RequestError, StartReplica, TokenChunk, decode, encode
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process


@pytest.fixture
def router():
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(max_attempts=3, first_token_timeout=10,
                                                           replica_expiry=2.0, request_timeout=60), {"echo"})
    r = ZmqRouter(dispatcher, context=zmq.Context()).start()
    yield r
    r.stop()
    r.context.destroy(linger=0)


def start_echo(router: ZmqRouter, replica_id: str, step_delay: float):
    spec = StartReplica(replica_id=replica_id, model="echo", model_dir="-", router_backend=router.backend_endpoint,
                        settings=EngineSettings(engine="echo", max_batch_size=64, max_seq_len=4096,
                                                options={"tokens_per_step": 1, "step_delay": step_delay}),
                        stats_interval=0.2)
    return spawn_replica(spec, "test-node")


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_replica_killed_mid_stream_every_request_completes(router):
    replicas = [start_echo(router, f"echo/r{i}", step_delay=0.01) for i in range(3)]
    try:
        wait_for(lambda: len(router.snapshot()["replicas"]) == 3)
        gateway = router.context.socket(zmq.DEALER)
        gateway.connect(router.frontend_endpoint)
        n, max_tokens = 24, 60
        ids = [uuid.uuid4().hex for _ in range(n)]
        for rid in ids:
            gateway.send(encode(GenerateRequest(request_id=rid, model="echo", prompt_token_ids=[256, 65, 66, 67],
                                                max_tokens=max_tokens)))
        tokens = {rid: 0 for rid in ids}
        finished: set[str] = set()
        killed = False
        deadline = time.monotonic() + 30
        while len(finished) < n and time.monotonic() < deadline:
            if gateway.poll(100):
                message = decode(gateway.recv())
                assert not isinstance(message, RequestError), message
                assert isinstance(message, TokenChunk)
                tokens[message.request_id] += len(message.token_ids)
                if message.finished:
                    finished.add(message.request_id)
                    assert message.completion_tokens == max_tokens
            if not killed and sum(tokens.values()) > n * 5:
                os.kill(replicas[0].process.pid, signal.SIGKILL)  # mid-stream, no goodbye
                killed = True
        assert killed
        assert finished == set(ids)
        assert all(count == max_tokens for count in tokens.values()), tokens
        wait_for(lambda: router.snapshot()["completed"] == n, timeout=2)  # the snapshot trails by one tick
        snap = router.snapshot()
        assert snap["retries"] >= 1 and snap["failed"] == 0 and snap["completed"] == n
        gateway.close(linger=0)
    finally:
        for r in replicas:
            if r.process.poll() is None:
                r.process.terminate()
            r.process.wait(10)


def test_several_gateways_share_one_router_and_each_gets_only_its_own_replies(router):
    replicas = [start_echo(router, f"echo/g{i}", step_delay=0.002) for i in range(2)]
    gateways = []
    try:
        wait_for(lambda: len(router.snapshot()["replicas"]) == 2)
        gateways = [router.context.socket(zmq.DEALER) for _ in range(3)]
        sent: dict[int, set[str]] = {}
        for g, sock in enumerate(gateways):
            sock.connect(router.frontend_endpoint)
            sent[g] = {f"gw{g}-{i}" for i in range(10)}
        for i in range(10):  # interleaved, so the router has requests of every gateway in flight at once
            for g, sock in enumerate(gateways):
                sock.send(encode(GenerateRequest(request_id=f"gw{g}-{i}", model="echo",
                                                 prompt_token_ids=[256, 65 + g, 66], max_tokens=8)))
        got: dict[int, dict[str, int]] = {g: {} for g in sent}
        deadline = time.monotonic() + 20
        while any(len([r for r, n in got[g].items() if n == 8]) < 10 for g in got) and time.monotonic() < deadline:
            for g, sock in enumerate(gateways):
                while sock.poll(0):
                    message = decode(sock.recv())
                    assert isinstance(message, TokenChunk), message
                    assert message.request_id in sent[g], f"gateway {g} got {message.request_id}"
                    got[g][message.request_id] = got[g].get(message.request_id, 0) + len(message.token_ids)
            time.sleep(0.005)
        for g in sent:
            assert got[g] == {rid: 8 for rid in sent[g]}
    finally:
        for sock in gateways:
            sock.close(linger=0)
        for r in replicas:
            if r.process.poll() is None:
                r.process.terminate()
            r.process.wait(10)


def test_a_router_bound_to_every_interface_is_published_under_the_node_name():
    """Agents and replicas on other nodes get this endpoint: they cannot connect to 0.0.0.0."""
    import socket as pysocket

    from exaserve_hpc.config.schema import RouterConfig
    from exaserve_hpc.router.zmq_router import bind
    assert RouterConfig().bind_host(across_nodes=False) == "127.0.0.1"
    assert RouterConfig().bind_host(across_nodes=True) == "0.0.0.0"
    assert RouterConfig(host="10.1.2.3").bind_host(across_nodes=True) == "10.1.2.3"
    context = zmq.Context()
    try:
        server, client = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        endpoint = bind(server, "0.0.0.0", 0)
        assert endpoint.startswith(f"tcp://{pysocket.getfqdn()}:")
        client.connect(endpoint)
        client.send(b"hello")
        assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
        assert bind(context.socket(zmq.ROUTER), "127.0.0.1", 0).startswith("tcp://127.0.0.1:")
    finally:
        context.destroy(linger=0)
