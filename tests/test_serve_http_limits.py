"""Limits at the HTTP door (issue 25 item 3), through a real `exaserve serve` with the site's defaults: other
local processes holding 20,000 idle connections (two processes of 10,000, each within this machine's
RLIMIT_NOFILE hard limit of 20,000; 300 of them slow senders that never finish their headers) do not
starve the server's own clients, its file descriptors or its disk. Traffic only to 127.0.0.1; the attack
is bounded in count (COUNT) and time (HOLD seconds); every wait is on a condition."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import start_serve

pytestmark = pytest.mark.process

HOLDER = Path(__file__).with_name("hold_connections.py")
PROCESSES, PER_PROCESS = 2, 10_000  # 20,000 connections in all
SLOW = 150  # per process: slow senders (a header line, then a byte each 0.5 s)
HOLD = 20.0  # seconds the holders run
REOPEN = 200  # per process: connections the server closed opened again, a second
HEADER_TIMEOUT = 10.0  # gateway.header_timeout's default
KEEP_ALIVE = 5.0  # gateway.keep_alive_timeout's default


def hold(port: int, count: int, seconds: float, slow: int, *more: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HOLDER), str(port), str(count), str(seconds), "--slow", str(slow),
                             *more], stdout=subprocess.PIPE, text=True)


def report(holder: subprocess.Popen) -> dict:
    out, _ = holder.communicate(timeout=60)
    assert holder.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def echo_site(tmp: Path) -> Path:
    site = {"site": "doors", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp / "run"), "weight_cache": {"l3_path": str(tmp / "models")},
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 1, "max_seq_len": 4096}]}
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def log_bytes(log_dir: Path, lines: list[str]) -> int:
    return sum(p.stat().st_size for p in log_dir.glob("*") if p.is_file()) + sum(len(line) for line in lines)


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def test_twenty_thousand_idle_connections_neither_starve_the_servers_clients_nor_fill_its_log(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < PER_PROCESS + 200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {PER_PROCESS + 200}")
    log_dir = tmp_path / "logs"
    process, url, lines = start_serve(echo_site(tmp_path), env={"EXASERVE_LOG_DIR": str(log_dir)})
    port = int(url.rsplit(":", 1)[1])
    holders: list[subprocess.Popen] = []
    try:
        with httpx.Client(timeout=30) as http:  # a replica serves before the attack starts
            deadline = time.monotonic() + 60
            while http.get(f"{url}/health").status_code != 200:
                assert time.monotonic() < deadline, "no replica served"
                time.sleep(0.2)
        before = log_bytes(log_dir, lines)
        holders = [hold(port, PER_PROCESS, HOLD, SLOW, "--reopen", str(REOPEN)) for _ in range(PROCESSES)]
        latencies: list[tuple[str, float, object]] = []  # (what, seconds, status)
        peak_fds = [0]
        done = threading.Event()

        def watch_fds() -> None:
            while not done.is_set():
                peak_fds[0] = max(peak_fds[0], open_fds(process.pid))
                done.wait(0.2)

        watcher = threading.Thread(target=watch_fds, daemon=True)
        watcher.start()
        # The server's own clients, all the while: a new connection each time (keep-alive would hide a full
        # accept queue), a generation and the health check.
        while any(h.poll() is None for h in holders):
            for what, call in (("health", lambda c: c.get(f"{url}/health")),
                               ("completion", lambda c: c.post(f"{url}/v1/completions", json={
                                   "model": "echo", "prompt": "still here?", "max_tokens": 8}))):
                started = time.monotonic()
                try:
                    with httpx.Client(timeout=10) as fresh:
                        status = call(fresh).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                latencies.append((what, time.monotonic() - started, status))
        done.set()
        watcher.join()
        reports = [report(h) for h in holders]
        # No pressure now: a few idle and slow connections, closed by the timeouts alone
        quiet = report(hold(port, 200, HEADER_TIMEOUT + 6, 100))
        status = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                                 str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
        grown = log_bytes(log_dir, lines) - before
    finally:
        for h in holders:
            if h.poll() is None:
                h.kill()
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    summary = {"holders": reports, "probes": len(latencies), "slowest": max(latencies, key=lambda x: x[1]),
               "peak_server_fds": peak_fds[0], "log_growth": grown, "quiet": quiet}
    print(summary)
    assert sum(r["count"] for r in reports) == PROCESSES * PER_PROCESS, summary
    assert sum(r["opened"] for r in reports) >= PROCESSES * PER_PROCESS, summary  # every connection was made
    assert len(latencies) >= 20, summary
    assert [x for x in latencies if x[2] != 200 or x[1] >= 1.0] == [], summary
    assert status.returncode == 0, status.stderr
    # the server held no more than its cap (gateway.max_connections, 4096) and its own descriptors
    assert peak_fds[0] < 4096 + 1000, summary
    # without pressure: idle connections closed after keep_alive_timeout, slow senders after header_timeout
    # (plus the sweep's period and the load's delay), every one
    assert quiet["closed_by_server"] == 200, summary
    count, shortest, longest = quiet["slow_lifetimes"]
    assert count == 100 and KEEP_ALIVE < shortest and longest < HEADER_TIMEOUT + 3, summary
    count, shortest, longest = quiet["idle_lifetimes"]
    assert count == 100 and longest < KEEP_ALIVE + 3, summary
    assert grown < 1 << 20, summary
    assert "Traceback" not in "".join(lines)
