"""Through a real `exaserve serve`: hashed keys made by `exaserve keys add`, a wrong key's 401, the usage ledger
(`exaserve usage` totals equal what the openai client counted from the responses' usage fields, also after a
restart), and no key in the server's logs, its run directory or its status."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from serve_harness import start_serve, stop_serve

pytestmark = pytest.mark.process


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EXASERVE_ADMIN_KEY": ""})


def send(url: str, key: str, counted: dict, group: str, n: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    for i in range(n):
        if i % 2:
            answer = client.completions.create(model="echo", prompt=f"request {i} of {group}", max_tokens=5 + i)
            usage = answer.usage
        else:  # streamed, usage in the last chunk
            usage = [c for c in client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": f"chat {i} " * (i + 1)}], max_tokens=7,
                stream=True, stream_options={"include_usage": True}) if c.usage][-1].usage
        counted[group][0] += usage.prompt_tokens
        counted[group][1] += usage.completion_tokens


def ledger_totals(site: Path) -> dict:
    done = cli("usage", "--site", str(site), "--by", "group", "--csv")
    assert done.returncode == 0, done.stderr
    return {row["group"]: [int(row["prompt_tokens"]), int(row["completion_tokens"])]
            for row in csv.DictReader(io.StringIO(done.stdout))}


def test_usage_ledger_matches_client_counts_across_a_restart_and_keys_stay_secret(tmp_path):
    site_path = tmp_path / "site.yaml"
    site = {"site": "quota-serve", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp_path / "run"), "weight_cache": {"l3_path": str(tmp_path / "models")},
            "gateway": {"require_api_key": True},
            "quota_groups": [{"name": "climate", "account": "clim001", "key_file": str(tmp_path / "climate.keys")},
                             {"name": "bio", "account": "bio002", "key_file": str(tmp_path / "bio.keys")}],
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 1, "max_seq_len": 4096}]}
    site_path.write_text(yaml.safe_dump(site))
    keys = {}
    for group in ("climate", "bio"):
        made = cli("keys", "add", group, "--site", str(site_path))
        assert made.returncode == 0, made.stderr
        keys[group] = made.stdout.strip()
    counted = {"climate": [0, 0], "bio": [0, 0]}
    logs = []
    for run in range(2):  # the second run is a restart: the ledger continues
        process, url, lines = start_serve(site_path, env={"EXASERVE_LOG_LEVEL": "DEBUG"})
        try:
            send(url, keys["climate"], counted, "climate", 5)
            send(url, keys["bio"], counted, "bio", 3)
            with pytest.raises(openai.AuthenticationError):
                send(url, keys["bio"][:-2] + "zz", counted, "bio", 1)
            admin = (tmp_path / "run" / "admin.key").read_text().strip()
            request = urllib.request.Request(f"{url}/v1/exaserve/status", headers={"Authorization": f"Bearer {admin}"})
            with urllib.request.urlopen(request, timeout=10) as response:
                status = response.read().decode()
            metrics_request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {admin}"})
            with urllib.request.urlopen(metrics_request, timeout=10) as response:
                metrics_text = response.read().decode()
        finally:
            stop_serve(process, lines)
        logs += lines
        assert ledger_totals(site_path) == counted, f"run {run}"
        for key in keys.values():
            assert key not in status and key not in metrics_text
    assert counted["climate"][1] > 0 and counted["bio"][1] > 0
    # no key in the server's output (DEBUG logs included) nor in any file it wrote
    everything = "".join(logs)
    assert "request" in everything.lower()  # the logs were captured
    for key in keys.values():
        assert key not in everything
        for path in (tmp_path / "run").rglob("*"):
            if path.is_file() and path.stat().st_size < 50_000_000:
                assert key.encode() not in path.read_bytes(), path
    accounts = cli("usage", "--site", str(site_path), "--by", "account", "--csv")
    assert {row["account"] for row in csv.DictReader(io.StringIO(accounts.stdout))} == {"clim001", "bio002"}
