"""The Grafana dashboard (deploy/grafana/exaserve-dashboard.json): valid JSON with the sections operators
look for, every panel expression names only metrics /metrics carries, and (with Prometheus installed)
every expression is PromQL a real Prometheus accepts."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from exaserve_hpc.observability.collector import exported_names

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "exaserve-dashboard.json"
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "count_values", "topk", "bottomk", "quantile", "stddev", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool", "rate", "increase",
    "irate", "delta", "histogram_quantile", "time", "le", "inf", "nan"}


def expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every query target, Grafana's variables replaced by what they match."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$model", ".*").replace("$node", ".*"))
            for p in panels for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """Identifiers of an expression that are series names: not in strings, label matchers, ranges or
    groupings, not a function (followed by '('), not a PromQL keyword."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", bare):
        following = bare[match.end():].lstrip()
        if match.group() in PROMQL_WORDS or following.startswith("("):
            continue
        names.add(match.group())
    return names


def test_the_dashboard_is_json_with_the_sections_and_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Cluster", "Models", "Groups", "Replicas", "Nodes"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model", "node"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")


def test_every_expression_names_only_exported_metrics():
    exported = exported_names()
    seen = set()
    for title, expr in expressions():
        names = metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        assert names <= exported, f"panel {title!r} reads {sorted(names - exported)}, which /metrics never carries"
        seen |= names
    # The seed's two metrics and the per-node telemetry are on the dashboard.
    assert {"exaserve_replica_queue_depth", "exaserve_kv_cache_hit_rate", "exaserve_gpu_utilization_ratio"} <= seen


def test_the_name_check_catches_a_misspelt_metric():
    assert metric_names('sum by (model) (rate(exaserve_replica_qeue_depth{model=~".*"}[5m]))') == {
        "exaserve_replica_qeue_depth"}
    assert not metric_names('sum by (model) (rate(exaserve_replica_qeue_depth[5m]))') <= exported_names()


@pytest.mark.prometheus
def test_every_expression_is_promql_prometheus_accepts(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
    log = open(tmp_path / "prometheus.log", "w")
    process = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/api/v1/query?query="
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "1", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
                time.sleep(0.3)
        bad = []
        for title, expr in expressions() + [("broken on purpose", "sum by (model (exaserve_replicas)")]:
            try:
                urllib.request.urlopen(base + urllib.parse.quote(expr), timeout=5).close()
            except urllib.error.HTTPError as exc:
                bad.append((title, exc.code, json.load(exc).get("error")))
        assert [b[0] for b in bad] == ["broken on purpose"], bad
    finally:
        process.terminate()
        process.wait(timeout=30)
