"""`exaserve serve` keeps its node agent running (issue 13 item 5): a kill -9 of the agent under load is
repaired, the old agent is reaped (no zombie), its replica processes end, new ones start under a new agent,
and the service answers again within 15 s. Echo replicas: the figures are the serving path's own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import alive, start_serve, stop_serve
from tests.waiting import wait_for

pytestmark = pytest.mark.process


def status(url: str) -> dict:
    return httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False


def test_a_killed_agent_is_restarted_and_serving_resumes_within_15s(tmp_path):
    site = {"site": "agent-restart", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp_path / "run"), "weight_cache": {"l3_path": str(tmp_path / "models")},
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 2, "min_replicas": 2,
                        "max_seq_len": 4096}]}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    process, url, lines = start_serve(path)
    try:
        before = status(url)
        old_agent = before["agents"][0]["pid"]
        old_replicas = [r["pid"] for r in before["replicas"]]
        assert old_agent and len(old_replicas) == 2 and all(old_replicas), before["replicas"]
        results: list[tuple[float, int]] = []  # (sent at, status)
        done = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=30) as http:
                while not done.is_set():
                    sent = time.monotonic()
                    try:
                        code = http.post(f"{url}/v1/completions", json={"model": "echo", "prompt": "load " * 20,
                                                                       "max_tokens": 32}).status_code
                    except httpx.HTTPError:
                        code = 0
                    results.append((sent, code))
                    if code != 200:
                        time.sleep(0.05)

        clients = [threading.Thread(target=client) for _ in range(8)]
        for c in clients:
            c.start()
        wait_for(lambda: sum(code == 200 for _, code in results) >= 40, 60, "requests answered before the kill")
        killed_at = time.monotonic()
        os.kill(old_agent, signal.SIGKILL)
        deadline = killed_at + 30
        while time.monotonic() < deadline:
            now = status(url)
            if (now["agents"][0]["pid"] != old_agent
                    and sum(r["state"] == "serving" and r["pid"] not in old_replicas for r in now["replicas"]) == 2):
                print(f"new agent and both replicas serving {time.monotonic() - killed_at:.2f}s after the kill")
                break
            time.sleep(0.2)
        time.sleep(3.0)  # more load on the new replicas
        done.set()
        for c in clients:
            c.join()
        after = status(url)
        assert process.poll() is None, "".join(lines)
        new_agent = after["agents"][0]["pid"]
        assert new_agent != old_agent and alive(new_agent)
        assert not alive(old_agent) and not zombie(old_agent)
        assert not any(alive(pid) or zombie(pid) for pid in old_replicas)
        assert sum(r["state"] == "serving" for r in after["replicas"]) == 2, after["replicas"]
        assert all(r["pid"] not in old_replicas for r in after["replicas"])
        # serving again: from the first request sent after the kill from which every later one succeeded
        later = sorted(r for r in results if r[0] >= killed_at)
        bad = [sent for sent, code in later if code != 200]
        recovered = next(sent for sent, code in later if code == 200 and (not bad or sent > bad[-1]))
        print(f"agent killed: {len(bad)} failed requests, serving again after {recovered - killed_at:.2f}s, "
              f"{len(later)} requests after the kill")
        assert recovered - killed_at < 15.0
        assert any("started a new one" in line for line in lines), "".join(lines)
    finally:
        if process.poll() is None:
            stop_serve(process, lines)
