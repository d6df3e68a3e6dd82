"""`exaserve status --watch`: the local alert checks on a status reading, the live view's frames as rich
renders them to a terminal (captured), and the command against a real `exaserve serve`."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from exaserve_hpc.observability.watch import local_alerts, watch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_harness import start_serve, stop_serve, write_local_site  # noqa: E402


def status(lost: bool = False, queue: int = 0, restarts: int = 0, serving: int = 2, completed: int = 0,
           hits: int = 90, queries: int = 100) -> dict:
    return {
        "site": "obs",
        "agents": [{"agent_id": "n1", "hostname": "n1", "state": "alive", "heartbeat_age": 0.4,
                    "host_memory_used": 2 << 30, "host_memory_total": 8 << 30, "l2": {"used": 1 << 30, "capacity": 4 << 30}},
                   {"agent_id": "n2", "hostname": "n2", "state": "lost" if lost else "alive",
                    "heartbeat_age": 16.0 if lost else 0.3, "l2": None}],
        "replicas": [{"replica_id": "tiny/r0000", "model": "tiny", "state": "serving", "node": "n1",
                      "endpoint": "tcp://x", "queue_depth": queue, "outstanding": 3, "restarts": restarts, "detail": ""},
                     {"replica_id": "tiny/r0001", "model": "tiny", "state": "serving" if serving > 1 else "failed",
                      "node": "n2", "endpoint": "tcp://x" if serving > 1 else None, "queue_depth": 0,
                      "outstanding": 0, "restarts": 0, "detail": "exit 1"}],
        "models": [{"model": "tiny", "current": serving, "target": 2, "min_replicas": 2, "load": 0.3,
                    "decision": "hold"}],
        "router": {"inflight": 3, "pending": 0, "completed": completed, "failed": 0, "retries": 1,
                   "prefix_hit_tokens": hits, "prefix_query_tokens": queries},
    }


def test_a_healthy_fleet_fires_nothing():
    assert local_alerts(status()) == []


def test_each_condition_fires_the_rule_it_stands_for():
    fired = {name for name, _ in local_alerts(status(lost=True, queue=21, restarts=3, hits=10, queries=100))}
    assert fired == {"NodeLost", "HighReplicaQueueDepth", "ReplicaFlapping", "LowKVCacheHitRate"}
    assert {n for n, _ in local_alerts(status(queue=20, restarts=2, hits=50))} == set()  # thresholds as the rules
    none_serving = status(serving=0)
    none_serving["replicas"][0]["state"] = "failed"
    assert "NoReplicaServingModel" in {n for n, _ in local_alerts(none_serving)}
    silent = status()
    silent["replicas"][0]["endpoint"] = None
    assert [n for n, _ in local_alerts(silent)] == ["ReplicaNotReporting"]


def test_an_elected_controller_not_acting_as_leader_fires_the_leader_count_rule():
    led = status()
    led["ha"] = {"leader": "rank-0", "node": "n1", "acting": True}
    assert local_alerts(led) == []
    led["ha"]["acting"] = False
    assert [n for n, _ in local_alerts(led)] == ["ControllerLeaderCount"]


def test_every_alert_rule_is_either_evaluated_here_or_named_as_not_checked():
    import yaml

    from exaserve_hpc.observability.watch import CHECKED, NOT_CHECKED
    rules = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    assert sorted(CHECKED + NOT_CHECKED) == sorted(names)


def test_the_live_view_refreshes_nodes_replicas_load_and_alerts():
    frames = iter([status(completed=100), status(completed=160, lost=True, queue=25)])
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160, color_system=None)
    times = iter([10.0, 12.0])
    slept = []
    assert watch(lambda: next(frames), "http://gw", interval=2.0, count=2, console=console, sleep=slept.append,
                 clock=lambda: next(times)) == 0
    text = buffer.getvalue()
    assert slept == [2.0]
    first, _, last = text.partition("30.0 req/s")  # (160 - 100) completed over 2 s: only the second frame
    assert last, text
    assert "none firing" in first and "NodeLost" not in first
    for expected in ("n1", "n2", "lost", "tiny/r0000", "NodeLost: node n2 lost", "HighReplicaQueueDepth",
                     "25", "not checked here"):
        assert expected in last, (expected, last)


def test_an_unreachable_gateway_is_shown_and_retried():
    answers = iter([OSError("connection refused"), status()])

    def fetch():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    buffer = io.StringIO()
    watch(fetch, "http://gw", count=2, console=Console(file=buffer, force_terminal=True, width=160),
          sleep=lambda s: None)
    assert "cannot reach exaserve at http://gw" in buffer.getvalue() and "tiny/r0001" in buffer.getvalue()


@pytest.mark.process
def test_status_watch_against_a_running_server(tmp_path):
    process, url, lines = start_serve(write_local_site(tmp_path))
    try:
        run = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--url", url, "--watch",
                              "--count", "2", "--interval", "0.2"], capture_output=True, text=True, timeout=60)
    finally:
        stop_serve(process, lines)
    assert run.returncode == 0, run.stderr
    for expected in ("tiny-llama/r0000", "tiny-llama/r0001", "serving", "2/2", "none firing"):
        assert expected in run.stdout, (expected, run.stdout)
