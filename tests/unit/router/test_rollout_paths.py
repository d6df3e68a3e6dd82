"""Rollout checkpoint paths (issue 25 item 6): resolved once, every ancestor and file checked, then frozen.

A checkpoint under a directory another user owns (or can write without the sticky bit) is refused, as is one
holding a link, a special file, or a file of another user; a path with a NUL byte, a relative one and a too
long one get 422, never 500. An accepted checkpoint is frozen into the run-private directory (hard links to
the inodes that were checked), and that copy is what is verified and handed to the fleet: renaming or
replacing the original afterwards changes nothing served.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint
from exaserve_hpc.cache.manifest import verify_checkpoint
from exaserve_hpc.gateway.admin_api import make_admin_router
from exaserve_hpc.router.canary import RolloutTable

OTHER = 65534  # nobody: "another user"
AUTH = {"Authorization": "Bearer k"}
SPEC = TinyModelSpec(layers=1, hidden=16, heads=2, kv_heads=1, intermediate=32, shards=1)
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")


def admin(tmp: Path, roots: list[Path]):
    table, changes = RolloutTable(), []

    def apply(fn):
        f: Future = Future()
        try:
            f.set_result(fn(table))
        except Exception as exc:  # noqa: BLE001 - handed to the route like ZmqRouter.call does
            f.set_exception(exc)
        return f

    app = FastAPI()
    app.include_router(make_admin_router(apply, admin_key="k", roots=roots, private_root=tmp / "run" / "rollouts",
                                         on_change=lambda action, r, v, d: changes.append(d)))
    return TestClient(app), table, changes


def start(client: TestClient, model_dir: str):
    return client.post("/v1/exaserve/rollouts/start", json={"model": "m", "version": "v2", "model_dir": model_dir},
                       headers=AUTH)


@pytest.fixture
def models(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.mark.parametrize("path", ["/models/a\x00b", "relative/ckpt", "/" + "a" * 5000, ""])
def test_invalid_paths_are_4xx_not_500(tmp_path, models, path):
    client, table, _ = admin(tmp_path, [models])
    r = start(client, path.replace("/models", str(models), 1))
    assert r.status_code == 422, r.text
    assert table.rollouts == {}


@root_only
def test_a_checkpoint_under_a_directory_another_user_owns_is_refused(tmp_path, models):
    theirs = models / "theirs"
    theirs.mkdir(mode=0o755)
    good = create_tiny_checkpoint(theirs / "v2", SPEC)  # ours, but in their directory: they can rename it
    os.chown(theirs, OTHER, OTHER)
    client, table, changes = admin(tmp_path, [models])
    r = start(client, str(good))
    assert r.status_code == 403 and "theirs" in r.json()["detail"] and "uid 65534" in r.json()["detail"], r.text
    assert table.rollouts == {} and changes == []


def test_ancestors_writable_by_others_are_refused_unless_sticky(tmp_path, models):
    shared = models / "shared"
    shared.mkdir()
    good = create_tiny_checkpoint(shared / "v2", SPEC)
    shared.chmod(0o777)  # anyone can rename v2 away and put theirs in its place
    client, table, _ = admin(tmp_path, [models])
    r = start(client, str(good))
    assert r.status_code == 403 and "writable by others" in r.json()["detail"]
    shared.chmod(0o1777)  # sticky, like /tmp: only the owner of v2 (us) can rename it
    r = start(client, str(good))
    assert r.status_code == 200, r.text


@root_only
def test_a_file_of_another_user_a_link_or_a_special_file_is_refused(tmp_path, models):
    client, table, _ = admin(tmp_path, [models])
    cases = {}
    for case in ("owner", "writable", "link", "fifo"):
        ckpt = Path(create_tiny_checkpoint(models / case, SPEC))
        if case == "owner":
            os.chown(ckpt / "config.json", OTHER, OTHER)
        elif case == "writable":
            (ckpt / "config.json").chmod(0o666)
        elif case == "link":
            shard = next(ckpt.glob("*.safetensors"))
            shutil.move(shard, tmp_path / shard.name)
            shard.symlink_to(tmp_path / shard.name)
        else:
            os.mkfifo(ckpt / "extra")
        cases[case] = start(client, str(ckpt))
    assert {c: r.status_code for c, r in cases.items()} == dict.fromkeys(cases, 403), \
        {c: r.text for c, r in cases.items()}
    assert table.rollouts == {}
    assert not list((tmp_path / "run" / "rollouts").iterdir())  # refused copies are removed


def test_the_checked_checkpoint_is_frozen_and_a_later_swap_changes_nothing_served(tmp_path, models):
    good = Path(create_tiny_checkpoint(models / "v2", SPEC))
    other = Path(create_tiny_checkpoint(models / "other", TinyModelSpec(**{**SPEC.__dict__, "seed": 7})))
    original = {p.name: p.read_bytes() for p in good.iterdir()}
    client, table, changes = admin(tmp_path, [models])
    r = start(client, str(good))
    assert r.status_code == 200, r.text
    [served] = changes
    served = Path(served)
    assert served.parent == tmp_path / "run" / "rollouts" and oct(served.parent.stat().st_mode & 0o777) == "0o700"
    good.rename(models / "v2.old")  # the swap: another checkpoint put where the checked one was
    other.rename(good)
    verify_checkpoint(served)
    assert {p.name: p.read_bytes() for p in served.iterdir()} == original
    # hard links to the very inodes checked (same filesystem here), not a second read of the path
    assert {p.name: p.stat().st_ino for p in served.iterdir()} == \
        {p.name: p.stat().st_ino for p in (models / "v2.old").iterdir()}
