"""The router under `exaserve launch`: frontend and backend admit only the job's CURVE client key.

Real ZmqRouter, real keys from transport.make_curve_keys, real sockets: a peer with the job's key
is served; a plain DEALER or one with a key of its own reaches nothing and gets nothing, on either
side, and the router goes on serving the job's peers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.lifecycle import Lifecycle
from exaserve_hpc.agent.replica_process import ReplicaSlot, spawn
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, CurveKeys, ZapLease, load_client_keys, make_curve_keys, secure_client, secure_server
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.protocol import (
    EngineSettings, GenerateRequest, ReplicaHello, StartReplica, TokenChunk, decode, encode,
)
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.gateway.router_client import RouterClient
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter
from tests.unit.router.test_kv_events_router import wait_for

HANDSHAKE_S = 15.0  # a CURVE handshake is slow on a busy machine
REFUSED = "refused a CURVE client"


@pytest.fixture
def job(tmp_path):
    jobdir = JobDir(tmp_path / "job").ensure()
    return jobdir, make_curve_keys(jobdir)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def make_router(context, keys=None) -> ZmqRouter:
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(first_token_timeout=30, replica_expiry=60,
                                                           request_timeout=60), {"m"})
    return ZmqRouter(dispatcher, context=context, curve=keys).start()


def dealer(context, endpoint: str, keys: CurveKeys | None, identity: bytes = b"") -> zmq.Socket:
    """A CURVE client with `keys` (the job's, or a key pair of its own), or a plain DEALER (None)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(endpoint)
    return sock


def hello(replica_id: str) -> bytes:
    return encode(ReplicaHello(replica_id=replica_id, model="m", pid=1, max_batch_size=8, max_seq_len=512))


def request(request_id: str) -> bytes:
    return encode(GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2, 3], max_tokens=4))


def send_if_it_can(sock: zmq.Socket, frame: bytes) -> None:
    """An outsider's send: once the router has refused its handshake its DEALER has no pipe left and a
    blocking send would wait forever (this hung the suite once), so it sends only if it can now."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def registered(router: ZmqRouter) -> list[str]:
    return [r["replica_id"] for r in router.snapshot()["replicas"]]


def test_the_router_serves_the_job_key_and_nobody_else(job, context, caplog):
    jobdir, keys = job
    client_keys = load_client_keys(jobdir)  # what gateways and replicas read from the job directory
    foreign = CurveKeys(keys.server_public, b"", *zmq.curve_keypair())
    router = make_router(context, keys)
    sockets = []

    def connect(endpoint, with_keys, identity=b""):
        sockets.append(dealer(context, endpoint, with_keys, identity))
        return sockets[-1]

    caplog.set_level(logging.WARNING, logger="exaserve.bootstrap")
    try:
        impostors = [connect(router.backend_endpoint, None, b"m/plain"),
                     connect(router.backend_endpoint, foreign, b"m/foreign")]
        for sock, rid in zip(impostors, ("m/plain", "m/foreign")):
            send_if_it_can(sock, hello(rid))
        replica = connect(router.backend_endpoint, client_keys, b"m/good")
        replica.send(hello("m/good"))
        assert wait_for(lambda: registered(router) == ["m/good"], HANDSHAKE_S), registered(router)

        outsiders = [connect(router.frontend_endpoint, None), connect(router.frontend_endpoint, foreign)]
        for i, sock in enumerate(outsiders):
            send_if_it_can(sock, request(f"outsider-{i}"))
        gateway = connect(router.frontend_endpoint, client_keys)
        for round_ in range(2):  # the router goes on serving the job's peers after the refusals
            rid = f"good-{round_}-{uuid.uuid4().hex[:6]}"
            gateway.send(request(rid))
            assert replica.poll(HANDSHAKE_S * 1000), "the job's replica got no request"
            assert decode(replica.recv()).request_id == rid  # never an outsider's request
            replica.send(encode(TokenChunk(request_id=rid, token_ids=[7], finished=True, finish_reason="stop",
                                           prompt_tokens=3, completion_tokens=1)))
            assert gateway.poll(HANDSHAKE_S * 1000), "the job's gateway got no reply"
            reply = decode(gateway.recv())
            assert (reply.request_id, reply.token_ids) == (rid, [7])

        for sock in impostors + outsiders:  # not served: no request, no error, nothing at all
            assert sock.poll(1000) == 0
        assert not replica.poll(0)
        assert registered(router) == ["m/good"]
        snap = router.snapshot()
        assert snap["pending"] == 0 and snap["inflight"] == 0
        # The foreign key kept reconnecting all along; each socket logged it once.
        refusals = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
        assert sorted(m.split(":")[0] for m in refusals) == ["router backend", "router frontend"], refusals
        assert all(foreign.client_public.decode() in m for m in refusals)
    finally:
        for sock in sockets:
            sock.close(0)
        router.stop()
    assert context not in ZapLease._by_context  # stop() ended the authenticator


def test_without_keys_the_router_admits_plain_peers_as_under_serve(context):
    router = make_router(context)
    replica = dealer(context, router.backend_endpoint, None, b"m/r0")
    try:
        replica.send(hello("m/r0"))
        assert wait_for(lambda: registered(router) == ["m/r0"], timeout=5)
        assert context not in ZapLease._by_context
    finally:
        replica.close(0)
        router.stop()


def test_controller_and_router_in_one_context_share_its_authenticator(job, context):
    """libzmq serves ZAP once per context: a second ThreadAuthenticator there cannot start."""
    _, keys = job
    control = context.socket(zmq.ROUTER)
    control.setsockopt(zmq.LINGER, 0)
    control_lease = secure_server(control, keys, context)  # what the Controller does
    port = control.bind_to_random_port("tcp://127.0.0.1")
    router = make_router(context, keys)
    auth, checks = ZapLease._by_context[context]
    assert set(checks) == {f"{name}/{keys.server_public.decode()}"
                           for name in ("controller", "router frontend", "router backend")}
    agent = dealer(context, f"tcp://127.0.0.1:{port}", load_client_keys(job[0]))
    try:
        agent.send(b"hello")
        assert control.poll(HANDSHAKE_S * 1000) and control.recv_multipart()[1] == b"hello"
        router.stop()
        assert context in ZapLease._by_context  # the controller still needs it
        control_lease.stop()
        control_lease.stop()  # idempotent
        assert context not in ZapLease._by_context and not auth.is_alive()
        late = dealer(context, f"tcp://127.0.0.1:{port}", load_client_keys(job[0]))
        send_if_it_can(late, b"late")
        assert control.poll(1000) == 0  # no authenticator left: fail closed (ZAP_ENFORCE_DOMAIN), not open
        late.close(0)
    finally:
        agent.close(0)
        control.close(0)


@pytest.mark.process
def test_a_replica_process_reads_the_keys_its_agent_names(job, context):
    """The agent hands a replica the job directory (a path in its environment, never a key)."""
    jobdir, keys = job
    router = make_router(context, keys)
    slots = []

    def start(replica_id: str, extra_env):
        spec = StartReplica(replica_id=replica_id, model="m", model_dir="-", router_backend=router.backend_endpoint,
                            settings=EngineSettings(engine="echo", max_batch_size=8, max_seq_len=512),
                            stats_interval=0.2, drain_timeout=2.0)
        slots.append(ReplicaSlot(spec, Lifecycle(time.monotonic())))
        spawn(slots[-1], "test-node", "", "", extra_env)

    async def generate(client: RouterClient) -> list[int]:
        tokens = []
        async for chunk in client.stream(GenerateRequest(request_id=uuid.uuid4().hex, model="m",
                                                         prompt_token_ids=[256, 65, 66], max_tokens=3)):
            tokens += chunk.token_ids
        await client.close()
        return tokens

    try:
        start("m/plain", None)  # no keys: it never registers
        start("m/good", {CURVE_JOB_DIR_VARIABLE: str(jobdir.path)})
        assert wait_for(lambda: "m/good" in registered(router), timeout=30), registered(router)
        client = RouterClient(router.frontend_endpoint, [ModelInfo("m", 512, 0)], reply_timeout=20,
                              curve=load_client_keys(jobdir))
        assert len(asyncio.run(generate(client))) == 3
        assert registered(router) == ["m/good"]
    finally:
        router.stop()
        for slot in slots:  # killed: the refused one blocks in a send to a router that never admits it
            slot.process.kill()
            slot.process.wait(10)


def test_a_peer_flooding_malformed_frames_costs_a_few_log_lines_is_refused_and_others_are_served(context, caplog):
    """20,000 undecodable or multipart frames from one peer: each kind logged once and the refusal once
    (peer_guard.PeerGuard), the peer's later messages dropped unread, a well-formed replica registered
    after it; a frame past MAX_MESSAGE_BYTES drops its sender's connection unread."""
    from exaserve_hpc.router import zmq_router
    router = make_router(context)
    rogue = dealer(context, router.backend_endpoint, None, b"rogue")
    big = dealer(context, router.frontend_endpoint, None, b"big")
    replica = dealer(context, router.backend_endpoint, None, b"m/r0")
    try:
        with caplog.at_level(logging.WARNING, logger="exaserve_hpc.router.zmq_router"):
            for i in range(20_000):
                if i % 2:
                    rogue.send(b"\xc1not msgpack")
                else:
                    rogue.send_multipart([b"a", b"b"])
            big.send(b"\x00" * (zmq_router.MAX_MESSAGE_BYTES + 1))
            assert wait_for(lambda: router.snapshot().get("peer_guard", {}).get("dropped_messages", 0) >= 20_000,
                            timeout=30)
            replica.send(hello("m/r0"))
            assert wait_for(lambda: registered(router) == ["m/r0"], timeout=10)
        guard = router.snapshot()["peer_guard"]
        assert guard["refused_peers"] == ["rogue"], guard
        lines = [r.getMessage() for r in caplog.records if "rogue" in r.getMessage()]
        assert 2 <= len(lines) <= 3 and any("refusing peer" in line for line in lines), lines
        assert not any("big" in r.getMessage() for r in caplog.records)  # never read, so never logged
    finally:
        for sock in (rogue, big, replica):
            sock.close(0)
        router.stop()
