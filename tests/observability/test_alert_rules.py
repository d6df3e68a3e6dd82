"""The alert rules (deploy/prometheus/alerts.yml) under promtool: every rule has a firing and a quiet
case in alerts.test.yml, reads only metrics the project exports, and a broken rule fails its test."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from exaserve_hpc.observability.collector import exported_names

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((RULES_DIR / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


@pytest.mark.prometheus
def test_promtool_checks_the_rules_and_passes_their_tests(tmp_path):
    check = subprocess.run([promtool(), "check", "rules", "alerts.yml"], cwd=RULES_DIR, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    run = subprocess.run([promtool(), "test", "rules", "alerts.test.yml"], cwd=RULES_DIR, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.prometheus
def test_a_broken_rule_fails_its_promtool_case(tmp_path):
    """The cases pin the thresholds: the seed's queue depth rule at > 30 instead of > 20 must fail."""
    shutil.copy(RULES_DIR / "alerts.test.yml", tmp_path)
    text = (RULES_DIR / "alerts.yml").read_text()
    assert "expr: exaserve_replica_queue_depth > 20" in text
    (tmp_path / "alerts.yml").write_text(text.replace("exaserve_replica_queue_depth > 20",
                                                      "exaserve_replica_queue_depth > 30"))
    run = subprocess.run([promtool(), "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "HighReplicaQueueDepth" in run.stdout + run.stderr


def test_every_rule_has_a_firing_and_a_quiet_case():
    cases = yaml.safe_load((RULES_DIR / "alerts.test.yml").read_text())["tests"]
    firing, quiet = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in rules()}
    assert names >= {"HighReplicaQueueDepth", "LowKVCacheHitRate", "NodeLost", "ReplicaFlapping",
                     "WeightChecksumFailure", "QuotaExhausted", "ControllerCheckpointFailing",
                     "NoReplicaServingModel", "ControllerLeaderCount", "ControllerEtcdErrors"}
    assert names - firing == set() and names - quiet == set()


def test_the_seed_rules_are_as_the_seed_writes_them():
    by_name = {r["alert"]: r for r in rules()}
    assert by_name["HighReplicaQueueDepth"]["expr"] == "exaserve_replica_queue_depth > 20"
    assert by_name["HighReplicaQueueDepth"]["for"] == "2m"
    assert by_name["LowKVCacheHitRate"]["expr"] == "exaserve_kv_cache_hit_rate < 0.5"
    assert by_name["LowKVCacheHitRate"]["for"] == "5m"


def test_every_rule_reads_only_exported_metrics():
    exported = exported_names()
    for rule in rules():
        used = set(re.findall(r"\bexaserve_\w+", rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, f"{rule['alert']} reads {sorted(used - exported)}, which /metrics never carries"
