"""The rollout swap attack against a running `exaserve serve` (issue 25 item 6).

Another user (uid 65534) owns a directory under the model root, and our checkpoint for version v2 lies in it:
v2 holds the stable model's own weights (a copy of the site's checkpoint), so answers from v2 and from the
stable version are the same. Right after `rollout start`, the owner of that directory renames v2 away and puts
their own checkpoint (other weights, a valid manifest) in its place. The server must refuse the start, or serve
the weights that were checked: every answer at canary weight 1.0 equals the stable answer; never the other
user's. Before this change the start was accepted (only the leaf's owner was checked) and the canary replica
loaded the swapped weights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = [pytest.mark.process, pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown to another uid")]

MODEL = "tiny-llama"
KEY = "swap-admin-key"
OTHER = 65534
PROMPTS = [f"Tell me about request number {i}" for i in range(4)]


def answers(client: openai.OpenAI) -> dict[str, str]:
    return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS}


def replicas(url: str) -> list[tuple[str, str]]:
    status = httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()
    return [(r["version"], r["state"]) for r in status["replicas"]]


def chown_tree(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), uid, uid)
    os.chown(path, uid, uid)


def test_a_checkpoint_swapped_after_rollout_start_is_never_served(tmp_path: Path):
    site_file = write_local_site(tmp_path, scheduler=dict(tick_interval="200ms", min_replicas_per_model=1,
                                                          max_replicas_per_node=4),
                                 router=dict(admin_key=KEY), model=dict(replicas=1, min_replicas=1))
    models = tmp_path / "models"
    evil_made = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "model", "create-tiny",
                                str(tmp_path / "evil"), "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert evil_made.returncode == 0, evil_made.stderr
    process, url, lines = start_serve(site_file)
    try:
        theirs = models / "theirs"
        theirs.mkdir(mode=0o755)
        v2 = theirs / "v2"
        shutil.copytree(models / MODEL, v2)  # ours: the stable weights under a new version name
        shutil.move(str(tmp_path / "evil"), theirs / "evil")
        chown_tree(theirs / "evil", OTHER)
        os.chown(theirs, OTHER, OTHER)  # their directory: they may rename what is in it

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        deadline = time.monotonic() + 60
        while ("", "serving") not in replicas(url) and time.monotonic() < deadline:
            time.sleep(0.2)
        stable = answers(client)

        started = httpx.post(f"{url}/v1/exaserve/rollouts/start", timeout=120,
                             headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": MODEL, "version": "v2", "model_dir": str(v2), "weight": 1.0})
        # the swap, as the owner of `theirs` can do it (root here stands in for uid 65534)
        if v2.exists():
            os.rename(v2, theirs / "v2.old")
            os.rename(theirs / "evil", v2)
        if started.status_code != 200:  # refused: fine, as long as it is refused cleanly and nothing changes
            assert started.status_code == 403 and "theirs" in started.text, started.text
            time.sleep(1.0)
            assert all(version == "" for version, _ in replicas(url))
            assert answers(client) == stable
        else:  # accepted: whatever the canary serves must be the weights that were checked
            deadline = time.monotonic() + 60
            while ("v2", "serving") not in replicas(url) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ("v2", "serving") in replicas(url), replicas(url)
            time.sleep(0.5)
            assert answers(client) == stable, "the canary served the swapped weights"
    except BaseException:
        process.kill()
        process.wait()
        raise
    stop_serve(process, lines)
