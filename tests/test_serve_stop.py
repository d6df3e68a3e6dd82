"""Stopping well, through a real `exaserve serve`: SIGUSR1 (Slurm's warning before the time limit) and
SIGTERM (scancel, preemption) write the controller's state, drain, remove the node's L2 files, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exaserve_hpc.controller_state import CHECKPOINT_FILE, load_state
from serve_harness import alive, start_serve, write_local_site

pytestmark = pytest.mark.process


def l2_files(l2_path: Path) -> list[Path]:
    return [p for p in l2_path.rglob("*") if p.is_file()]


def serving_pids(run_dir: Path) -> list[int]:
    import json
    status = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    return [r["pid"] for r in state["replicas"]] + [a["pid"] for a in state["agents"]]


@pytest.mark.parametrize("stop_signal", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_checkpoints_drains_and_empties_l2(tmp_path, stop_signal):
    l2 = tmp_path / "shm"
    site_file = write_local_site(tmp_path, weight_cache={"l2_path": str(l2)})
    process, url, lines = start_serve(site_file)
    try:
        pids = serving_pids(tmp_path / "run")
        assert l2_files(l2), "the replicas' weights were not staged in L2"
        assert not (tmp_path / "run" / CHECKPOINT_FILE).exists()
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(lines)
    assert f"{stop_signal.name} received" in output
    state = load_state(tmp_path / "run" / CHECKPOINT_FILE)
    assert sorted(state.placement) == ["tiny-llama/r0000", "tiny-llama/r0001"], output
    assert {node for _, node in state.placement.values()} == {"localhost"}, "written after the drain, not before"
    assert l2_files(l2) == [], "the agent left L2 files behind"
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


def test_a_restarted_serve_restores_the_checkpoint_and_writes_it_periodically(tmp_path):
    site_file = write_local_site(tmp_path, requeue={"checkpoint_interval": "1s"})
    process, url, lines = start_serve(site_file)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "run" / CHECKPOINT_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "run" / CHECKPOINT_FILE).exists(), "no periodic checkpoint"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, "".join(lines)
        process, url, lines = start_serve(site_file)
        assert any("restored state from" in line for line in lines), "".join(lines)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
    assert os.path.exists(tmp_path / "run" / CHECKPOINT_FILE)


def test_a_stop_signal_just_after_serve_json_is_written_still_stops_gracefully(tmp_path):
    """serve.json tells a script the server is up: a USR1 from then on, before the gateway's own handlers
    exist (widened here to 3 s by the gateway_late fault step), must drain and exit 0, not kill."""
    site_file = write_local_site(tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "EXASERVE_INJECT_FAILURE": "gateway_late:3"})
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "run" / "serve.json").exists() and process.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "run" / "serve.json").exists(), "serve did not start"
        process.send_signal(signal.SIGUSR1)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert code == 0, output
    assert "SIGUSR1 received" in output and (tmp_path / "run" / CHECKPOINT_FILE).exists(), output
    assert not (tmp_path / "run" / "serve.json").exists()
