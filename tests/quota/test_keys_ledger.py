"""Hashed API keys, `exaserve keys add`, the usage ledger and `exaserve usage` (no server: see test_quota_serve)."""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from exaserve_hpc.quota.keys import KeyFileError, KeyRing, hash_key, read_key_file
from exaserve_hpc.quota.ledger import UsageLedger, UsageRecord, read_usage, summarize


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True, timeout=60)


def test_keyring_finds_the_group_of_a_key_and_nothing_for_others():
    ring = KeyRing([(hash_key("k-climate"), "climate"), (hash_key("k-bio"), "bio")])
    assert ring.group_of("k-climate") == "climate" and ring.group_of("k-bio") == "bio"
    assert ring.group_of("k-climat") is None and ring.group_of("") is None and ring.group_of(hash_key("k-bio")) is None


def test_key_file_open_to_others_or_holding_a_plaintext_key_is_refused(tmp_path):
    path = tmp_path / "climate.keys"
    path.write_text(hash_key("a") + "\n")
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="mode 644.*chmod 600"):
        read_key_file(path, "climate")
    path.chmod(0o600)
    assert read_key_file(path, "climate") == [hash_key("a")]
    path.write_text("a-plaintext-key-by-mistake\n")
    with pytest.raises(KeyFileError, match="line 1 is not a key hash") as caught:
        read_key_file(path, "climate")
    assert "a-plaintext-key-by-mistake" not in str(caught.value)


def test_serve_and_config_check_refuse_a_key_file_open_to_others_in_one_line_and_leave_nothing(tmp_path):
    key_file = tmp_path / "climate.keys"
    key_file.write_text(hash_key("a") + "\n")
    key_file.chmod(0o644)
    site = {"site": "keys-test", "run_dir": str(tmp_path / "run"), "cluster": {"nodes": 1, "nodelist": "localhost"},
            "weight_cache": {"l3_path": str(tmp_path / "models")}, "gateway": {"port": 0},
            "models": [{"model_name": "echo", "engine": "echo", "max_seq_len": 512}],
            "quota_groups": [{"name": "climate", "key_file": str(key_file)}]}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    served = cli("serve", "--site", str(tmp_path / "site.yaml"))
    assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
    assert "key_file" in served.stderr and "chmod 600" in served.stderr and len(served.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
    checked = cli("config", "check", str(tmp_path / "site.yaml"))
    assert checked.returncode == 2 and "mode 644" in checked.stderr, checked


def test_keys_add_prints_the_key_once_and_stores_only_its_hash(tmp_path):
    key_file = tmp_path / "keys" / "climate"
    site = {"site": "keys-test", "run_dir": str(tmp_path / "run"), "models": [{"model_name": "m"}],
            "quota_groups": [{"name": "climate", "key_file": str(key_file)},
                             {"name": "bio", "account": "bio002"}]}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    first, second = (cli("keys", "add", "climate", "--site", str(tmp_path / "site.yaml")) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr
    keys = [first.stdout.strip(), second.stdout.strip()]
    assert keys[0] != keys[1] and all(len(k) >= 40 for k in keys)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    stored = key_file.read_text()
    assert all(k not in stored for k in keys) and stored.split() == [hash_key(k) for k in keys]
    # without a key file: the hash to paste into api_key_hashes, which then parses
    bio = cli("keys", "add", "bio", "--site", str(tmp_path / "site.yaml"))
    assert bio.returncode == 0 and hash_key(bio.stdout.strip()) in bio.stderr and bio.stdout.strip() not in bio.stderr
    site["quota_groups"][1]["api_key_hashes"] = [hash_key(bio.stdout.strip())]
    from exaserve_hpc.config.schema import parse_site
    ring = KeyRing.from_site(parse_site(site))
    assert ring.group_of(keys[1]) == "climate" and ring.group_of(bio.stdout.strip()) == "bio"
    unknown = cli("keys", "add", "physics", "--site", str(tmp_path / "site.yaml"))
    assert unknown.returncode == 2 and "physics" in unknown.stderr and "climate, bio" in unknown.stderr


def test_config_refuses_a_malformed_hash_and_visible_to_an_unknown_group():
    from exaserve_hpc.config.schema import ConfigError, parse_site
    with pytest.raises(ConfigError, match=r"api_key_hashes"):
        parse_site({"site": "s", "models": [{"model_name": "m"}],
                    "quota_groups": [{"name": "g", "api_key_hashes": ["md5:abc"]}]})
    with pytest.raises(ConfigError, match=r"visible_to names 'physics', not among quota_groups \(g\)"):
        parse_site({"site": "s", "models": [{"model_name": "m", "visible_to": ["physics"]}],
                    "quota_groups": [{"name": "g"}]})


def record(t: float, group: str, model: str, prompt: int, completion: int, account: str = "") -> UsageRecord:
    return UsageRecord(t=t, request_id=f"r{t}", group=group, account=account, model=model, prompt_tokens=prompt,
                       completion_tokens=completion, gpu_seconds=0.5)


def test_ledger_appends_durably_survives_a_torn_line_and_a_second_process(tmp_path):
    first = UsageLedger(tmp_path)
    first.record(record(100.0, "climate", "m", 10, 5, "clim001"))
    first.record(record(200.0, "bio", "m", 7, 3, "bio002"))
    first.close()
    first.record(record(250.0, "bio", "m", 1, 1, "bio002"))  # finishing during a shutdown: written at once
    with open(first.path, "ab") as f:
        f.write(b'{"t": 300, "group": "cli')  # a crash mid-write
    second = UsageLedger(tmp_path)  # a restarted gateway: a file of its own beside the first
    second.record(record(400.0, "climate", "other", 2, 2, "clim001"))
    second.close()
    assert second.path != first.path and stat.S_IMODE(first.path.stat().st_mode) == 0o600
    rows = {r["group"]: r for r in summarize(read_usage(tmp_path), by="group")}
    assert rows["climate"]["prompt_tokens"] == 12 and rows["climate"]["completion_tokens"] == 7
    assert rows["bio"]["requests"] == 2 and rows["bio"]["total_tokens"] == 12 and rows["bio"]["gpu_seconds"] == 1.0
    windowed = summarize(read_usage(tmp_path), by="account", since=150, until=400)
    assert [(r["account"], r["requests"]) for r in windowed] == [("bio002", 2)]


def test_ledgers_made_in_one_millisecond_write_files_of_their_own(tmp_path, monkeypatch):
    from exaserve_hpc.quota import ledger as ledger_module
    clock = SimpleNamespace(time=lambda: 1_700_000_000.0, sleep=time.sleep)  # one millisecond for all of them
    monkeypatch.setattr(ledger_module, "time", clock)
    ledgers = [UsageLedger(tmp_path) for _ in range(3)]
    assert len({ledger.path for ledger in ledgers}) == 3
    for n, ledger in enumerate(ledgers):
        ledger.record(record(100.0 + n, "bio", "m", 10 * (n + 1), 0, "bio002"))
        ledger.close()
        assert ledger.offsets[ledger.path.name] == ledger.path.stat().st_size  # the positions it counts hold
    assert ledgers[0].path.name.startswith(f"usage-{socket.gethostname()}-{os.getpid()}-1700000000000-")
    assert sorted(r.prompt_tokens for r in read_usage(tmp_path)) == [10, 20, 30]


def test_usage_command_csv_by_model_and_time_window(tmp_path):
    ledger = UsageLedger(tmp_path / "usage")
    for t, model in ((1_700_000_000, "a"), (1_700_000_100, "a"), (1_800_000_000, "b")):
        ledger.record(record(float(t), "g", model, 3, 4))
    ledger.close()
    done = cli("usage", "--dir", str(tmp_path / "usage"), "--by", "model", "--csv", "--until", "2025-01-01")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert rows == [{"model": "a", "requests": "2", "prompt_tokens": "6", "completion_tokens": "8",
                     "total_tokens": "14", "gpu_seconds": "1.0"}]
    bad = cli("usage", "--dir", str(tmp_path / "usage"), "--since", "yesterday")
    assert bad.returncode != 0 and "--since 'yesterday'" in bad.stderr


def test_usage_without_dir_reads_serves_ledger_and_the_job_roots(tmp_path):
    """`exaserve usage --site S` finds what `exaserve serve` wrote (<run_dir>/usage) and what every job of
    `exaserve submit`'s default job root wrote (<run_dir>/jobs/usage: requeued and successor jobs alike)."""
    run_dir = tmp_path / "run"
    site = tmp_path / "site.yaml"
    site.write_text(f"site: s\nrun_dir: {run_dir}\nmodels: [{{model_name: m}}]\n")
    for directory, tokens in ((run_dir / "usage", 3), (run_dir / "jobs" / "usage", 5)):
        ledger = UsageLedger(directory)
        ledger.record(record(1_700_000_000.0 + tokens, "g", "m", tokens, 1))
        ledger.close()
    done = cli("usage", "--site", str(site), "--by", "group", "--csv")
    assert done.returncode == 0, done.stderr
    [row] = list(csv.DictReader(io.StringIO(done.stdout)))
    assert row["requests"] == "2" and row["prompt_tokens"] == "8"
    missing = cli("usage", "--site", str(tmp_path / "site.yaml"), "--dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "no usage ledger" in missing.stderr
