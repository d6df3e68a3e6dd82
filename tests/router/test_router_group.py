"""Several routers sharing the fleet: the group's arithmetic (pure), the controller's channel to a router
on another rank (real ZmqRouter, real CURVE sockets), and a replica's links to every router."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from exaserve_hpc.agent import router_links
from exaserve_hpc.agent.router_links import RouterLinks
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.transport import make_curve_keys, secure_client
from exaserve_hpc.protocol import Drain, GenerateRequest, ReplicaHello, ReplicaStats, TokenChunk, decode, encode
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.router_group import RouterGroup, merge_snapshots
from exaserve_hpc.router.router_link import RemoteRouter, RouterControl
from exaserve_hpc.router.zmq_router import ZmqRouter
from waiting import wait_for


def test_merge_adds_each_routers_counts_and_outstanding_per_replica():
    first = {"accepted": 10, "inflight": 2, "pending": 1, "pending_by_model": {"m": 1}, "routing": {"balance": 10},
             "replicas": [{"replica_id": "m/r1", "outstanding": 2, "queue_depth": 5},
                          {"replica_id": "m/r2", "outstanding": 0, "queue_depth": 0}]}
    second = {"accepted": 7, "inflight": 3, "pending": 0, "pending_by_model": {"m": 2}, "routing": {"balance": 6,
                                                                                                      "retry": 1},
              "replicas": [{"replica_id": "m/r1", "outstanding": 1}, {"replica_id": "m/r3", "outstanding": 4}]}
    merged = merge_snapshots([first, second])
    assert merged["accepted"] == 17 and merged["inflight"] == 5 and merged["pending"] == 1
    assert merged["pending_by_model"] == {"m": 3} and merged["routing"] == {"balance": 16, "retry": 1}
    by_id = {r["replica_id"]: r for r in merged["replicas"]}
    assert by_id["m/r1"]["outstanding"] == 3 and by_id["m/r1"]["queue_depth"] == 5  # the engine's figure, once
    assert by_id["m/r3"]["outstanding"] == 4  # known to the second router only
    assert first["accepted"] == 10 and first["replicas"][0]["outstanding"] == 2  # inputs untouched


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def make_router(context, keys=None) -> ZmqRouter:
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(first_token_timeout=30, replica_expiry=60,
                                                           request_timeout=60), {"m"})
    return ZmqRouter(dispatcher, context=context, curve=keys).start()


def fake_replica(context, endpoint: str, keys) -> zmq.Socket:
    """A replica's DEALER (identity = replica id) that said hello; what a replica process does first."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"m/r1")
    secure_client(sock, keys)
    sock.connect(endpoint)
    sock.send(encode(ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64)))
    return sock


def test_a_remote_router_takes_the_controllers_news_and_reports_its_counts(context, tmp_path):
    keys = make_curve_keys(JobDir(tmp_path / "job").ensure())
    router = make_router(context, keys)
    control = RouterControl(router, "127.0.0.1", curve=keys, context=context).start()
    info = {"rank": 1, "node": "n2", "frontend": router.frontend_endpoint, "backend": router.backend_endpoint,
            "control": control.endpoint, "gateway_url": "http://n2:8000"}
    remote = RemoteRouter(info, curve=keys, context=context).start()
    replica = None
    try:
        replica = fake_replica(context, router.backend_endpoint, keys)
        report = wait_for(lambda: (s := remote.snapshot()).get("replicas") and s, 15, "a report naming the replica")
        assert [r["replica_id"] for r in report["replicas"]] == ["m/r1"] and remote.alive
        remote.drain("m/r1")  # the controller's scale-down, carried to the other rank's router
        assert replica.poll(10_000), "the drain did not reach the replica through the remote router"
        assert isinstance(decode(replica.recv()), Drain)
        remote.replica_lost("m/r1", "node n3 lost")
        wait_for(lambda: not router.snapshot()["replicas"], 10, "the router dropping the lost replica")
        group = RouterGroup([make_router(context, keys), remote], ["http://n1:8000", ""])
        try:
            table = wait_for(lambda: [r for r in group.snapshot()["routers"] if r["index"] == 1
                                      and r["replicas"] == 0], 10, "the group's table")
            assert table[0]["state"] == "serving" and table[0]["backend"] == router.backend_endpoint
            assert group.backend_endpoints[1] == router.backend_endpoint
            # a canary rollout started through the admin API (router 0's table) reaches the other rank's router
            group.call(lambda d: d.rollouts.start("m", "v2", 0.25, stable="v1")).result(5)
            wait_for(lambda: router.snapshot()["rollouts"] == [{"model": "m", "stable": "v1", "canary": "v2",
                                                                 "weight": 0.25}], 10, "the rollout on router 1")
        finally:
            group.members[0].stop()
        control.stop()  # the router rank is gone: the link notices within REPORT_MISSES intervals
        wait_for(lambda: not remote.alive, 10, "the link marking the router lost")
    finally:
        remote.stop()
        control.stop()
        if replica is not None:
            replica.close(linger=0)
        router.stop()


def test_a_replica_answers_each_request_on_the_router_that_sent_it(context, monkeypatch):
    # a small pipe per router (read when the links' sockets are made), so the lost router's fills within the test
    monkeypatch.setattr(router_links, "LINK_HWM", 10)
    routers = [context.socket(zmq.ROUTER) for _ in range(2)]
    endpoints = []
    for sock in routers:
        sock.setsockopt(zmq.LINGER, 0)
        endpoints.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    links = RouterLinks(context, "m/r1", endpoints)
    try:
        links.broadcast(ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64))
        for sock in routers:  # every router hears the hello
            assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()[1]), ReplicaHello)
        for k, sock in enumerate(routers):
            sock.send_multipart([b"m/r1", encode(GenerateRequest(request_id=f"q{k}", model="m",
                                                                 prompt_token_ids=[1, 2], max_tokens=1))])
        deadline = time.monotonic() + 5
        got: list = []
        while len(got) < 2 and time.monotonic() < deadline:
            if links.poll(100):
                got += list(links.receive(16))
        assert sorted(m.request_id for m in got) == ["q0", "q1"]
        links.send(TokenChunk(request_id="q1", token_ids=[7], finished=True))
        links.send(TokenChunk(request_id="q0", token_ids=[5], finished=True))
        links.send(ReplicaStats(replica_id="m/r1", queue_depth=3))
        for k, sock in enumerate(routers):
            seen = []
            while sock.poll(1000):
                seen.append(decode(sock.recv_multipart()[1]))
            assert [m.request_id for m in seen if isinstance(m, TokenChunk)] == [f"q{k}"]
            assert [m.queue_depth for m in seen if isinstance(m, ReplicaStats)] == [3]  # load goes to both
        routers[1].close(linger=0)  # a router lost: sending to it must never block the replica
        sender = threading.Thread(target=lambda: [links.send(ReplicaStats(replica_id="m/r1", queue_depth=i))
                                                  for i in range(1000)], daemon=True)
        started = time.monotonic()
        sender.start()
        sender.join(10)  # a blocking send would wait for router 1 forever once its pipe of 10 is full
        assert not sender.is_alive() and time.monotonic() - started < 2.0
        assert links.dropped[1] >= 1000 - 100  # past the pipe (and what went out before the loss was seen): counted
        delivered = 0
        while routers[0].poll(1000):  # the live router gets every message its pipe took; the rest are counted
            delivered += isinstance(decode(routers[0].recv_multipart()[1]), ReplicaStats)
        assert delivered > 0 and delivered + links.dropped[0] == 1000
    finally:
        links.close()
        for sock in routers:
            sock.close(linger=0)


def test_an_elected_leaders_group_adopts_the_other_ranks_routers_and_keeps_its_own_running(tmp_path):
    """ha.etcd with router.count 3, rank 1 leading after nodea (rank 0) was lost: router 0 of its group is
    rank 1's own running router, rank 2's registration is adopted, the lost node's is not, and stopping the
    group leaves rank 1's router running (its lifetime is the rank's)."""
    from types import SimpleNamespace

    from exaserve_hpc.config.schema import SiteConfig
    from exaserve_hpc.app.several_routers import SeveralRouters, router_file, run_tag

    site = SiteConfig.model_validate({"site": "x", "cluster": {"nodes": 3, "nodelist": "n[1-3]"},
                                      "router": {"count": 3}, "ha": {"etcd": {"members": 3}},
                                      "models": [{"model_name": "echo", "engine": "echo", "max_seq_len": 64}]})
    (tmp_path / "routers").mkdir()
    for rank, node in enumerate(("nodea", "nodeb", "nodec")):
        (tmp_path / router_file(rank)).write_text(json.dumps({
            "run": run_tag("j", 0), "rank": rank, "node": node, "frontend": f"tcp://127.0.0.1:{7100 + rank}",
            "backend": f"tcp://127.0.0.1:{7200 + rank}", "control": f"tcp://127.0.0.1:{7300 + rank}",
            "gateway_url": f"http://127.0.0.1:{7400 + rank}"}))
    own = SimpleNamespace(frontend_endpoint="tcp://127.0.0.1:7101", backend_endpoint="tcp://127.0.0.1:7201",
                          stopped=False)
    own.stop = lambda timeout=5.0: setattr(own, "stopped", True)
    settings = SimpleNamespace(across_nodes=True, state_dir=str(tmp_path), job_id="j", restart=0, curve=None,
                               node_index=1, local_router=own, lost_nodes=("nodea",))
    routers = SeveralRouters(site, own, "127.0.0.1", settings, lambda fp, bp: None)
    assert routers.group.backend_endpoints == ["tcp://127.0.0.1:7201", "tcp://127.0.0.1:7202"]
    routers.stop()
    assert not own.stopped


def _stats(replica_id: str) -> ReplicaStats:
    return ReplicaStats(replica_id=replica_id, queue_depth=0, kv_used=0.0)


def test_a_router_that_expired_a_replica_asks_for_its_hello_and_the_replica_serves_it_again(context):
    """Real routers and a replica's real links: router A expires the replica (silent past its expiry), router
    B does not; when the replica speaks again A asks for its hello (before: Drain(timeout=0), which stopped
    the replica for both routers), the links send it to A alone, and both route to the replica again."""
    quick = ZmqRouter(Dispatcher(RoundRobin(), DispatchSettings(first_token_timeout=30, replica_expiry=0.5,
                                                                request_timeout=60), {"m"}), context=context).start()
    patient = make_router(context)
    links = RouterLinks(context, "m/r1", [quick.backend_endpoint, patient.backend_endpoint])
    registered = lambda router: [r["replica_id"] for r in router.snapshot()["replicas"]]  # noqa: E731
    try:
        links.broadcast(ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64))
        wait_for(lambda: registered(quick) == ["m/r1"] and registered(patient) == ["m/r1"], 10, "both hellos")
        wait_for(lambda: not registered(quick), 10, "router A expiring the silent replica")
        links.broadcast(_stats("m/r1"))  # the replica speaks again
        received = []
        deadline = time.monotonic() + 10
        while links.hellos_again == 0 and time.monotonic() < deadline:
            if links.poll(100):
                received += list(links.receive(16))
        assert links.hellos_again == 1 and not any(isinstance(m, Drain) for m in received), received
        wait_for(lambda: registered(quick) == ["m/r1"], 10, "router A taking the replica back")
        gateway = context.socket(zmq.DEALER)
        gateway.setsockopt(zmq.LINGER, 0)
        gateway.connect(quick.frontend_endpoint)
        gateway.send(encode(GenerateRequest(request_id="after", model="m", prompt_token_ids=[1, 2], max_tokens=1)))
        got, deadline = [], time.monotonic() + 10
        while not any(isinstance(m, GenerateRequest) for m in got) and time.monotonic() < deadline:
            if links.poll(100):
                got += list(links.receive(16))
        assert [m.request_id for m in got if isinstance(m, GenerateRequest)] == ["after"], got
        # Router B heard one hello only: a second would have re-registered the replica there (a fresh entry).
        assert patient.snapshot()["replicas"][0]["replica_id"] == "m/r1" and links.hellos_again == 1
        gateway.close(0)
    finally:
        links.close()
        quick.stop()
        patient.stop()


def test_the_dispatcher_asks_an_unknown_replica_for_its_hello_rather_than_draining_it():
    from exaserve_hpc.protocol import SayHello
    d = Dispatcher(RoundRobin(), DispatchSettings(), {"m"})
    [out] = d.on_replica_message("m/ghost", _stats("m/ghost"), 0.0)
    assert out.peer == b"m/ghost" and isinstance(out.message, SayHello)
    assert d.on_replica_message("m/ghost", TokenChunk(request_id="x", token_ids=[1]), 0.0) == []


def test_a_router_added_to_the_group_later_is_joined_by_a_replica_started_before_it(context):
    """Real routers and a replica's real links: the replica starts linked to router A alone (router B had not
    registered); B joins the group, A tells the replica (Routers), its links connect to B and say hello, and
    B routes a request to it with the answer coming back on B. Without Routers B would never see it."""
    first, late = make_router(context), make_router(context)
    group = RouterGroup([first])
    links = RouterLinks(context, "m/r1", [first.backend_endpoint])
    registered = lambda router: [r["replica_id"] for r in router.snapshot()["replicas"]]  # noqa: E731
    gateway = context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    try:
        links.broadcast(ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64))
        wait_for(lambda: registered(first) == ["m/r1"], 10, "the hello to router A")
        group.add(late)  # B registers late: A names every router to the replicas it knows
        deadline = time.monotonic() + 10
        while len(links.endpoints) < 2 and time.monotonic() < deadline:
            if links.poll(100):
                list(links.receive(16))
        assert links.endpoints == [first.backend_endpoint, late.backend_endpoint]
        wait_for(lambda: registered(late) == ["m/r1"], 10, "the replica's hello to router B")
        gateway.connect(late.frontend_endpoint)
        gateway.send(encode(GenerateRequest(request_id="via-b", model="m", prompt_token_ids=[1, 2], max_tokens=1)))
        got, deadline = [], time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            if links.poll(100):
                got += [m for m in links.receive(16) if isinstance(m, GenerateRequest)]
        assert [m.request_id for m in got] == ["via-b"]
        links.send(TokenChunk(request_id="via-b", token_ids=[7], finished=True, finish_reason="length"))
        assert gateway.poll(10_000), "router B never passed the answer back"
        answer = decode(gateway.recv())
        assert isinstance(answer, TokenChunk) and answer.token_ids == [7]
        assert links.dropped == [0, 0]
    finally:
        gateway.close(0)
        links.close()
        group.stop()  # both routers


def test_a_hello_lacking_a_router_is_answered_with_every_router():
    """The race the push cannot cover: a replica started with the old list says hello after the group changed."""
    from exaserve_hpc.protocol import Routers
    d = Dispatcher(RoundRobin(), DispatchSettings(), {"m"})
    assert d.set_routers(["tcp://a:1", "tcp://b:2"]) == []  # nobody registered yet: nobody to tell
    hello = ReplicaHello(replica_id="m/r1", model="m", pid=1, max_batch_size=4, max_seq_len=64, routers=["tcp://a:1"])
    told = [o for o in d.on_replica_message("m/r1", hello, 0.0) if isinstance(o.message, Routers)]
    assert [(o.peer, o.message.backends) for o in told] == [(b"m/r1", ["tcp://a:1", "tcp://b:2"])]
    hello.routers = ["tcp://a:1", "tcp://b:2"]  # a replica linked to both is not told again
    assert not [o for o in d.on_replica_message("m/r2", hello, 0.0) if isinstance(o.message, Routers)]
    pushed = d.set_routers(["tcp://a:1", "tcp://b:2", "tcp://c:3"])  # a third router: both replicas told
    assert sorted(o.peer for o in pushed) == [b"m/r1", b"m/r2"]
    assert all(o.message.backends[-1] == "tcp://c:3" for o in pushed)


def test_every_router_kind_is_a_router_port_and_routing_follows_its_loops(context):
    """router/port.py: ZmqRouter, RouterGroup and SimRouters implement one RouterPort (what the controller
    uses; nothing probes them with getattr); a group routes while any member does."""
    from exaserve_hpc.config.schema import parse_site
    from exaserve_hpc.router.port import RouterPort
    from exaserve_hpc.sim.routers import SimRouters
    import yaml
    from pathlib import Path
    first, second = make_router(context), make_router(context)
    group = RouterGroup([first, second])
    site = parse_site(yaml.safe_load((Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml").read_text()))
    sim = SimRouters(site, {"tiny-llama"}, clock=lambda: 0.0)
    try:
        for port in (first, group, sim):
            assert isinstance(port, RouterPort), type(port)
        assert group.backend_endpoints == [first.backend_endpoint, second.backend_endpoint]
        assert first.backend_endpoints == [first.backend_endpoint] and group.routing()
        first.stop()
        assert not first.routing() and group.routing()  # the other member still routes
        second.stop()
        assert not group.routing()
    finally:
        for router in (first, second):
            router.stop()
