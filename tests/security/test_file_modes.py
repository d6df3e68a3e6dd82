"""Everything a real `exaserve serve` writes is private to its user (issue 13 item 14): the run directory
and its files (keys, admin key, serve.json, controller state, KV snapshots), the L2 root with its per-user
directory and every file in it, and the tiny checkpoint it creates with its manifest: 0700 directories and
0600 files, checked by stat. Before, the run directory, the L2 root and the checkpoint were 0755 and the
manifests 0644."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


def modes(root: Path) -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(root):
        found[directory] = oct(stat.S_IMODE(os.stat(directory).st_mode))
        for name in files:
            path = os.path.join(directory, name)
            found[path] = oct(stat.S_IMODE(os.stat(path).st_mode))
    return found


def test_run_dir_l2_and_checkpoints_are_private(tmp_path):
    os.chmod(tmp_path, 0o755)
    (tmp_path / "shm").mkdir(mode=0o1777)
    os.chmod(tmp_path / "shm", 0o1777)  # like /dev/shm: shared, and left so
    site = write_local_site(tmp_path, weight_cache={"l2_path": str(tmp_path / "shm")},
                            requeue={"checkpoint_interval": "1s"})
    process, url, lines = start_serve(site, env={"EXASERVE_LOG_DIR": ""})
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "run" / "controller-state.h5").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        found = {}
        for root in (tmp_path / "run", tmp_path / "shm" / f"exaserve-l2-{os.getuid()}", tmp_path / "models"):
            found.update(modes(root))
        names = {Path(p).name for p in found}
        assert {"controller-state.h5", "serve.json", "server.key", "client.key", "kv-salt", "manifest.json",
                "config.json", ".exaserve-l2.json"} <= names, sorted(names)
        assert any(n.startswith("localhost@serve-") for n in names), sorted(names)  # the run's own L2 directory
        wrong = {p: m for p, m in found.items() if m != (oct(0o700) if os.path.isdir(p) else oct(0o600))}
        assert wrong == {}
        assert stat.S_IMODE((tmp_path / "shm").stat().st_mode) == 0o1777  # the shared place is not ours to close
    finally:
        stop_serve(process, lines)
