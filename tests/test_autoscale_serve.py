"""`exaserve serve` scales with load: a burst of concurrent requests adds replicas, idle removes them down to
the model's minimum, and no request fails on the way (scale-down drains before it stops).

The site: one replica to start, min_replicas 1, max_batch_size 2 (so a few concurrent requests are load
above scale_up_threshold 0.5), a 0.2 s scheduler tick and a 2 s cooldown. The tiny reference model keeps
requests busy for a while; max_replicas_per_node 3 bounds how many replica processes the burst starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


@pytest.fixture
def site_file(tmp_path: Path) -> Path:
    return write_local_site(tmp_path, scheduler=dict(tick_interval="200ms", cooldown_period="2s",
                                                     scale_up_threshold=0.5, min_replicas_per_model=1,
                                                     max_replicas_per_node=3),
                            model=dict(replicas=1, min_replicas=1, max_batch_size=2))


def ask(client: openai.OpenAI, stop: threading.Event, pause: float = 0.0) -> list[str]:
    """Requests one after another until `stop`; returns each one's outcome ("ok" or the error)."""
    outcomes = []
    while not stop.is_set():
        try:
            completion = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=48)
            outcomes.append("ok" if completion.usage.completion_tokens >= 1 else "no tokens")
        except openai.OpenAIError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        time.sleep(pause)
    return outcomes


def wait_status(url: str, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()
        if predicate(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; models {json.dumps(status.get('models'))}, "
                         f"replicas {[(r['replica_id'], r['state']) for r in status.get('replicas', [])]}")


def serving(status: dict) -> int:
    return sum(r["state"] == "serving" for r in status["replicas"])


def test_a_burst_scales_up_then_idle_scales_down_to_the_minimum_and_no_request_fails(site_file, tmp_path):
    process, url, lines = start_serve(site_file)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        burst, trickle = threading.Event(), threading.Event()
        with ThreadPoolExecutor(9) as pool:
            busy = [pool.submit(ask, client, burst) for _ in range(8)]
            slow = pool.submit(ask, client, trickle, 0.3)  # keeps going through the scale-down
            try:
                up = wait_status(url, lambda s: serving(s) >= 2, 30, "a scale-up to 2+ serving replicas")
            finally:
                burst.set()
            outcomes = [o for f in busy for o in f.result()]
            model = up["models"][0]
            assert model["last_scale"]["to"] > 1 and "scale_up_threshold 0.5" in model["last_scale"]["reason"]

            down = wait_status(url, lambda s: serving(s) == 1 and len(s["replicas"]) == 1, 20,
                               "a scale-down to the one-replica minimum")
            trickle.set()
            outcomes += slow.result()
        assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:5]
        model = down["models"][0]
        assert (model["current"], model["target"], model["min_replicas"]) == (1, 1, 1)
        assert "scale_down_threshold" in model["last_scale"]["reason"]
        assert down["router"]["failed"] == 0

        table = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--url", url],
                               capture_output=True, text=True, timeout=30)
        assert "models" in table.stdout and "1/1" in table.stdout, table.stdout
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)


def test_a_model_with_no_replicas_scales_up_on_its_first_request_and_back_to_zero(tmp_path):
    path = write_local_site(tmp_path, scheduler=dict(tick_interval="200ms", cooldown_period="2s",
                                                     min_replicas_per_model=0),
                            model=dict(replicas=0, min_replicas=0))
    process, url, lines = start_serve(path)
    try:
        assert serving(httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()) == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        # The request waits in the router; its demand starts a replica, which then serves it.
        completion = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8)
        assert completion.usage.completion_tokens == 8
        up = httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()
        assert serving(up) == 1 and "below" not in up["models"][0]["last_scale"]["reason"]
        down = wait_status(url, lambda s: not s["replicas"], 20, "a scale-down back to zero replicas")
        assert down["models"][0]["current"] == 0 and down["router"]["failed"] == 0
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
