"""A real Prometheus scraping a real `exaserve serve`: each replica's queue depth and prefix hit rate are
series in Prometheus, and stopping one replica's process (SIGSTOP: alive but silent, as a stalled replica
is) fires the shipped ReplicaNotReporting rule for that replica, its `for:` shortened to 2 s here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_harness import start_serve, stop_serve, write_local_site  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.prometheus]

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def query(prom: str, expr: str) -> list[dict]:
    answer = get_json(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def wait_for(what: str, check, timeout: float, logs=lambda: ""):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # Prometheus still starting
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last}\n{logs()}")


def complete(url: str, prompt: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_prometheus_sees_every_replica_and_fires_when_one_stalls(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    # The shipped rules, every `for:` made 2 s so a stall fires within the test.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "2s"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    site = write_local_site(tmp_path)
    process, url, lines = start_serve(site)
    prom_process = None
    stopped_pid = 0
    try:
        host, port = urllib.parse.urlparse(url).netloc.rsplit(":", 1)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "scrape_configs": [{"job_name": "exaserve", "static_configs": [{"targets": [f"{host}:{port}"]}]}]}))
        prom_port = free_port()
        prom = f"http://127.0.0.1:{prom_port}"
        log = open(tmp_path / "prometheus.log", "w")
        prom_process = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--web.console.templates=/dev/null",
             "--web.console.libraries=/dev/null"], stdout=log, stderr=subprocess.STDOUT)
        prom_logs = lambda: (tmp_path / "prometheus.log").read_text()[-3000:]  # noqa: E731

        # Enough concurrent prompts that the router gives each replica some (prefix lookups: a hit rate).
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: complete(url, f"prompt number {k} " * 8), range(16)))
        status = get_json(f"{url}/v1/exaserve/status")
        replicas = {r["replica_id"]: r for r in status["replicas"] if r["state"] == "serving"}
        assert len(replicas) == 2, status["replicas"]

        def per_replica(expr: str):
            found = {s["metric"]["replica"] for s in query(prom, expr)}
            return found if found == set(replicas) else None

        wait_for("each replica's queue depth in Prometheus", lambda: per_replica("exaserve_replica_queue_depth"),
                 60, prom_logs)
        wait_for("each replica's hit rate in Prometheus", lambda: per_replica("exaserve_kv_cache_hit_rate"), 30,
                 prom_logs)
        # The engines' own latency percentiles travel with their stats reports to the router.
        wait_for("each replica's TTFT p99 in Prometheus",
                 lambda: per_replica('exaserve_replica_time_to_first_token_seconds{quantile="0.99"} > 0'), 30,
                 prom_logs)
        up = query(prom, 'up{job="exaserve"}')
        assert up and up[0]["value"][1] == "1"
        victim = sorted(replicas)[0]

        def firing():
            alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "ReplicaNotReporting"
                    and a["labels"]["replica"] == victim and a["state"] == "firing"]

        assert not firing()
        stopped_pid = replicas[victim]["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)
        # (On a loaded machine the other replica may miss a stats report too; the victim's alert is the point.)
        alerts = wait_for(f"ReplicaNotReporting firing for {victim}", firing, 60, prom_logs)
        assert alerts[0]["labels"]["severity"] == "warning" and alerts[0]["labels"]["node"]
    finally:
        if stopped_pid:
            os.kill(stopped_pid, signal.SIGCONT)
        if prom_process is not None:
            prom_process.terminate()
            prom_process.wait(timeout=30)
        stop_serve(process, lines)
