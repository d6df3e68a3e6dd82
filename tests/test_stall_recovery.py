"""A replica stalled (SIGSTOP) long enough for the router to drop it, then resumed, is restarted or readmitted:
the model is back to its target through a real `exaserve serve` (its router told the resumed replica to
drain, which used to read as its node leaving: the replica was never replaced)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from serve_harness import alive, start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


def status(tmp_path) -> dict:
    run = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def serving(state: dict) -> dict[str, int]:
    return {r["replica_id"]: r["pid"] for r in state["replicas"] if r["state"] == "serving" and alive(r["pid"])}


def test_a_stalled_then_resumed_replica_is_replaced_and_the_model_is_back_to_target(tmp_path):
    site = write_local_site(tmp_path, router={"replica_heartbeat": "0.5s", "replica_misses": 2})
    process, url, lines = start_serve(site)
    try:
        deadline = time.monotonic() + 60
        while len(serving(state := status(tmp_path))) < 2:
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
        victim, pid = sorted(serving(state).items())[0]
        os.kill(pid, signal.SIGSTOP)
        # status says the stopped replica is not serving normally: its router dropped it after 1 s of silence
        deadline = time.monotonic() + 30
        while next(r for r in status(tmp_path)["replicas"] if r["replica_id"] == victim)["routed"]:
            assert time.monotonic() < deadline, "status still shows the stopped replica routed"
            time.sleep(0.2)
        table = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--run-dir", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "250"})
        assert any(victim in line and ("not routed" in line or "silent" in line)
                   for line in table.stdout.splitlines()), table.stdout
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 45
        while True:
            state = status(tmp_path)
            now = serving(state)
            (model,) = state["models"]
            assert model["current"] >= model["target"] or model["below_target"], model  # a reason while short
            if len(now) == 2 and victim in now and not any(a.get("leaving") for a in state["agents"]):
                break
            assert time.monotonic() < deadline, json.dumps(state["replicas"], indent=1)
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(4):
            assert client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4).usage.completion_tokens
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
