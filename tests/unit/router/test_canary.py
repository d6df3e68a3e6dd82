"""Canary rollouts: weights, stickiness, fallbacks, checksum refusal, admin routes and the CLI."""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint
from exaserve_hpc.protocol import GenerateRequest, ReplicaHello
from exaserve_hpc.cli.rollout import add_rollout_arguments, cmd_rollout
from exaserve_hpc.gateway.admin_api import make_admin_router
from exaserve_hpc.router.balancing import PowerOfTwo
from exaserve_hpc.router.canary import RolloutError, RolloutTable, check_version
from exaserve_hpc.router.dispatch import REPLICA, Dispatcher, DispatchSettings


def req(i: int, session: str = "", prompt=None) -> GenerateRequest:
    return GenerateRequest(request_id=f"q{i}", model="m", prompt_token_ids=prompt or [i % 251, i // 251, 7],
                           max_tokens=4, session_id=session)


def dispatcher() -> Dispatcher:
    d = Dispatcher(PowerOfTwo(seed=0), DispatchSettings(), {"m"})
    for rid, version in (("a1", ""), ("a2", ""), ("b1", "v2")):
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=64,
                                               max_seq_len=512, version=version), 0)
    return d


def version_of(d: Dispatcher, out) -> str:
    [peer] = [o.peer.decode() for o in out if o.side == REPLICA]
    return d.replicas[peer].version


def test_weights_split_traffic_and_conversations_stick():
    d = dispatcher()
    d.rollouts.start("m", "v2", weight=0.1)
    versions = Counter(version_of(d, d.on_request(b"g", req(i), 0)) for i in range(2000))
    assert 0.07 < versions["v2"] / 2000 < 0.13
    # The same conversation always lands on the same version.
    firsts = {version_of(d, d.on_request(b"g", req(10_000 + k, session="conv-42"), 0)) for k in range(20)}
    assert len(firsts) == 1
    prompt = [5] * 80
    assert len({version_of(d, d.on_request(b"g", req(20_000 + k, prompt=prompt + [k]), 0))
                for k in range(20)}) == 1


def test_no_rollout_uses_every_replica_and_missing_canary_gives_its_share_back():
    d = dispatcher()
    assert {version_of(d, d.on_request(b"g", req(i), 0)) for i in range(200)} == {"", "v2"}
    d.rollouts.start("m", "v3", weight=1.0)  # no v3 replica registered yet
    assert {version_of(d, d.on_request(b"g", req(1000 + i), 0)) for i in range(50)} == {""}


def test_a_canary_whose_replicas_cannot_take_a_request_gives_it_to_the_stable_version():
    d = dispatcher()
    d.rollouts.start("m", "v2", weight=1.0)
    assert version_of(d, d.on_request(b"g", req(0), 0)) == "v2"
    d.drain("b1")  # v2's only replica stops taking work (a breaker opening does the same)
    assert {version_of(d, d.on_request(b"g", req(1 + i), 0)) for i in range(20)} == {""}
    assert not d.pending


def test_promote_and_rollback_end_the_rollout():
    t = RolloutTable()
    t.start("m", "v2", 0.05)
    with pytest.raises(RolloutError, match="promote or roll it back"):
        t.start("m", "v3", 0.05)
    with pytest.raises(RolloutError) as e:
        t.promote("m", "v9")
    assert e.value.status == 409
    assert t.promote("m", "v2").as_dict() == {"model": "m", "stable": "v2", "canary": None, "weight": 0.0}
    t.start("m", "v3", 0.2)
    assert t.rollback("m", "v3").stable == "v2"
    with pytest.raises(RolloutError) as e:
        t.rollback("m", "v3")
    assert e.value.status == 404
    d = dispatcher()
    d.rollouts.start("m", "v2", 0.05)
    d.rollouts.promote("m", "v2")
    assert {version_of(d, d.on_request(b"g", req(i), 0)) for i in range(30)} == {"v2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    spec = TinyModelSpec(layers=1, hidden=16, heads=2, kv_heads=1, intermediate=32, shards=1)
    good = create_tiny_checkpoint(root / "good", spec)
    bad = create_tiny_checkpoint(root / "bad", spec)
    shard = next(Path(bad).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the weights
    shard.write_bytes(bytes(data))
    return str(good), str(bad)


def test_a_version_failing_its_checksums_is_refused(checkpoints):
    good, bad = checkpoints
    check_version(good)
    with pytest.raises(RolloutError) as e:
        check_version(bad)
    assert e.value.status == 422 and "failed verification" in str(e.value)


def admin_app(table: RolloutTable, **kw) -> FastAPI:
    def apply(fn):
        f: Future = Future()
        try:
            f.set_result(fn(table))
        except Exception as exc:  # noqa: BLE001 - handed to the route like ZmqRouter.call does
            f.set_exception(exc)
        return f
    app = FastAPI()
    app.include_router(make_admin_router(apply, **kw))
    return app


def test_admin_routes_without_a_key_refuse_everyone(checkpoints):
    good, _ = checkpoints
    table = RolloutTable()
    keyless = TestClient(admin_app(table))  # no key given: nobody is admitted, loopback or not
    r = keyless.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": good})
    assert r.status_code == 401 and "admin.key" in r.json()["detail"] and table.rollouts == {}
    assert keyless.get("/v1/exaserve/rollouts").status_code == 401
    assert keyless.get("/v1/exaserve/rollouts", headers={"Authorization": "Bearer "}).status_code == 401
    keyed = TestClient(admin_app(table, admin_key="k"))
    assert keyed.get("/v1/exaserve/rollouts", headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_checkpoint_outside_the_model_roots_or_writable_by_others_is_refused(checkpoints, tmp_path):
    good, _ = checkpoints
    root = Path(good).parent
    table = RolloutTable()
    client = TestClient(admin_app(table, admin_key="k", roots=[root]))
    auth = {"Authorization": "Bearer k"}
    outside = tmp_path / "elsewhere"
    shutil.copytree(good, outside)
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": str(outside)},
                    headers=auth)
    assert r.status_code == 403 and "allowed model root" in r.json()["detail"] and str(root) in r.json()["detail"]
    link = root / "link-out"
    link.symlink_to(outside)  # a link inside the root to a directory outside it is outside
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": str(link)},
                    headers=auth)
    assert r.status_code == 403
    shared = root / "shared"
    shutil.copytree(good, shared)
    shared.chmod(0o777)
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": str(shared)},
                    headers=auth)
    assert r.status_code == 403 and "writable by others" in r.json()["detail"] and table.rollouts == {}
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": good},
                    headers=auth)
    assert r.status_code == 200


def test_admin_routes_verify_before_traffic_and_need_the_key(checkpoints):
    good, bad = checkpoints
    table = RolloutTable()
    client = TestClient(admin_app(table, admin_key="k"))
    auth = {"Authorization": "Bearer k"}
    assert client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2"}).status_code == 401
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": bad}, headers=auth)
    assert r.status_code == 422 and "failed verification" in r.json()["detail"]
    assert table.rollouts == {}  # refused before it took traffic
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": good,
                                                          "weight": 0.05}, headers=auth)
    assert r.status_code == 200 and r.json()["rollout"]["canary"] == "v2"
    assert client.get("/v1/exaserve/rollouts", headers=auth).json()["rollouts"][0]["weight"] == 0.05
    r = client.post("/v1/exaserve/rollouts/promote", json={"model": "m", "version": "v9"}, headers=auth)
    assert r.status_code == 409
    r = client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v3"}, headers=auth)
    assert r.status_code == 422 and "pass model_dir" in r.json()["detail"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_talks_to_a_running_server(checkpoints, capsys, monkeypatch):
    import uvicorn

    good, bad = checkpoints
    table = RolloutTable()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(admin_app(table, admin_key="k"), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        parser = argparse.ArgumentParser()
        add_rollout_arguments(parser)
        url = f"http://127.0.0.1:{port}"
        run_dir = Path(good).parent / "run"
        run_dir.mkdir()
        (run_dir / "admin.key").write_text("k\n")  # as admin_key_for leaves it; read when no key is given
        monkeypatch.delenv("EXASERVE_ADMIN_KEY", raising=False)
        url = f"--url {url} --run-dir {run_dir}"
        assert cmd_rollout(parser.parse_args(["start", "m", "v2", "--model-dir", bad, *url.split()])) == 1
        assert "failed verification" in capsys.readouterr().err
        assert cmd_rollout(parser.parse_args(["start", "m", "v2", "--model-dir", good, "--weight", "0.05",
                                              *url.split()])) == 0
        assert "5% to v2" in capsys.readouterr().out
        assert cmd_rollout(parser.parse_args(["promote", "m", "v2", *url.split()])) == 0
        assert table.rollouts["m"].stable == "v2" and table.rollouts["m"].canary is None
    finally:
        server.should_exit = True
        thread.join(5)
