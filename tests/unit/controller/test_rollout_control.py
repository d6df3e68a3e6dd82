"""The controller's side of rollouts, without processes: how many canary replicas, which old ones a promote
stops and when, what the autoscaler may stop, where a version's checkpoint is found, and what the admin
routes tell the fleet. tests/test_rollout_serve.py runs the whole thing against `exaserve serve`."""

from __future__ import annotations

from concurrent.futures import Future

import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.cache.manifest import write_manifest
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.gateway.admin_api import make_admin_router
from exaserve_hpc.router.canary import RolloutTable
from exaserve_hpc.controller.fleet_state import ReplicaRecord
from exaserve_hpc.controller.rollout_control import (
    ModelVersions, RolloutFleet, canary_replicas, old_to_retire, version_dir,
)

from tests.slurm.fleet import ROOT


def record(i: int, version: str, serving: bool = True) -> ReplicaRecord:
    return ReplicaRecord(f"m/r{i:04d}", "m", agent_id="n0", version=version,
                         state=ReplicaState.SERVING if serving else ReplicaState.LOADING)


def test_a_canary_gets_its_share_of_the_stable_replicas_rounded_up_and_at_least_one():
    assert [canary_replicas(n, 0.05) for n in (0, 1, 20, 21)] == [1, 1, 1, 2]
    assert canary_replicas(4, 0.5) == 2 and canary_replicas(3, 1.0) == 3


def test_promote_stops_an_old_replica_only_for_each_new_one_serving_beyond_the_count():
    old = [record(0, ""), record(1, ""), record(2, "", serving=False)]
    assert old_to_retire(old, new_serving=0, wanted=3, routed={}) == []
    assert old_to_retire(old, new_serving=1, wanted=3, routed={}) == ["m/r0002"]  # the one not serving first
    busy = {"m/r0000": {"outstanding": 3}}
    assert old_to_retire(old, new_serving=2, wanted=3, routed=busy) == ["m/r0002", "m/r0001"]
    assert sorted(old_to_retire(old, new_serving=3, wanted=3, routed={})) == ["m/r0000", "m/r0001", "m/r0002"]


def test_the_autoscaler_never_stops_a_canary_and_waits_while_old_replicas_are_replaced():
    fleet = RolloutFleet(fleet=None)
    fleet.models["m"] = ModelVersions(stable="", canary="v2")
    stable, canary = record(0, ""), record(1, "v2")
    assert fleet.scalable("m", [stable, canary]) == [stable]
    fleet.models["m"] = ModelVersions(stable="v2")  # promoted; r0000 still runs the old version
    assert fleet.scalable("m", [stable, canary]) == []
    assert fleet.scalable("m", [canary]) == [canary]
    assert fleet.stable("m") == "v2" and fleet.stable("other") == ""


def test_a_version_checkpoint_is_found_next_to_the_models(tmp_path):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data["weight_cache"]["l3_path"] = str(tmp_path)
    site = parse_site(data)
    there = tmp_path / "tiny-llama@v2"
    assert version_dir(site, "tiny-llama", "v2") is None  # nothing there yet
    there.mkdir()
    (there / "w.bin").write_bytes(b"x")
    write_manifest(there)
    assert version_dir(site, "tiny-llama", "v2") == there
    assert version_dir(site, "tiny-llama", "../tiny-llama@v2") is None  # a version is a name, not a path
    assert version_dir(site, "other-model", "v2") is None


def test_admin_routes_tell_the_fleet_after_the_table_changed_and_refuse_unknown_models(tmp_path):
    table, told = RolloutTable(), []

    def apply(fn):
        future: Future = Future()
        try:
            future.set_result(fn(table))
        except Exception as exc:  # noqa: BLE001 - handed to the route, as ZmqRouter.call does
            future.set_exception(exc)
        return future

    def on_change(action, rollout, version, model_dir):
        told.append((action, rollout.as_dict(), version, model_dir, table.snapshot()))

    app = FastAPI()
    app.include_router(make_admin_router(apply, lambda m, v: f"/ckpt/{m}@{v}", verify=lambda d: None,
                                         on_change=on_change, models=["m"], admin_key="k"))
    client = TestClient(app, headers={"Authorization": "Bearer k"})
    assert client.post("/v1/exaserve/rollouts/start", json={"model": "x", "version": "v2"}).status_code == 404
    assert client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "weight": 0.5}).is_success
    assert client.post("/v1/exaserve/rollouts/promote", json={"model": "m", "version": "v9"}).status_code == 409
    assert client.post("/v1/exaserve/rollouts/promote", json={"model": "m", "version": "v2"}).is_success
    start, promote = told
    assert start[:4] == ("start", {"model": "m", "stable": "", "canary": "v2", "weight": 0.5}, "v2", "/ckpt/m@v2")
    assert start[4] == [start[1]]  # the table had changed when the fleet heard of it
    assert promote[:4] == ("promote", {"model": "m", "stable": "v2", "canary": None, "weight": 0.0}, "v2", None)
