"""Site config loading: every shipped file validates; every kind of mistake is reported with path, found, allowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exaserve_hpc.config.schema import ConfigError, load_site, parse_site, resolve_site

SITES = Path(__file__).resolve().parents[2] / "site-configs"
MINIMAL = {"site": "t", "models": [{"model_name": "m"}]}


def problems(data: dict) -> dict[str, tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_site(data, "test.yaml")
    return {p.path: (p.found, p.allowed) for p in info.value.problems}


def with_(path: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(MINIMAL))
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize("name", ["local", "slurm-local", "small16-a100", "exa256-a100"])
def test_shipped_site_configs_validate(name):
    site = load_site(SITES / f"{name}.yaml")
    assert site.site == name
    assert len(site.cluster.hostnames()) == site.cluster.nodes


def test_defaults_are_the_documented_ones():
    site = parse_site(MINIMAL)
    s = site.scheduler
    assert (s.max_replicas_per_node, s.min_replicas_per_model, s.rebalance_interval) == (16, 4, 30.0)
    assert (s.scale_up_threshold, s.scale_down_threshold, s.cooldown_period) == (0.75, 0.25, 120.0)
    assert (site.heartbeat.interval, site.heartbeat.misses, site.heartbeat.expiry) == (5.0, 3, 15.0)
    b = site.batching
    assert (b.max_batch_size, b.max_wait_ms, b.prefill_batch_size, b.decode_batch_size, b.chunked_prefill) == \
        (32, 50.0, 8, 64, True)
    m = site.models[0]
    assert (m.gpu_memory_utilization, m.enable_prefix_caching, m.kv_cache_dtype) == (0.90, True, "fp16")
    assert site.initial_replicas(m) == 4


def test_target_sites_have_the_promised_scale():
    small = load_site(SITES / "small16-a100.yaml")
    big = load_site(SITES / "exa256-a100.yaml")
    assert (small.cluster.nodes, small.cluster.gpus_per_node) == (16, 8)
    assert sum(small.initial_replicas(m) for m in small.models) == 192
    assert (big.cluster.nodes, big.cluster.gpus_per_node) == (256, 8)
    assert sum(big.initial_replicas(m) for m in big.models) == 3072
    assert len(local := load_site(SITES / "local.yaml").models) >= 1
    assert sum(local_site_replicas := [load_site(SITES / "local.yaml").initial_replicas(m) for m in local]) >= 2


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("2m", 120), ("500ms", 0.5), (45, 45), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_site(with_("scheduler.cooldown_period", text)).scheduler.cooldown_period == seconds


def test_unknown_key_lists_the_valid_keys():
    found = problems(with_("models.0.tensor_paralel", 2))
    found_value, allowed = found["models[0].tensor_paralel"]
    assert found_value == "2"
    assert "tensor_parallel" in allowed and "pipeline_parallel" in allowed


def test_every_error_is_reported_at_once():
    data = with_("models.0.kv_cache_dtype", "int4")
    data["scheduler"] = {"cooldown_period": "2 minutes", "scale_up_threshold": 1.5}
    data["heartbeat"] = {"misses": 0}
    found = problems(data)
    assert set(found) == {"models[0].kv_cache_dtype", "scheduler.cooldown_period",
                          "scheduler.scale_up_threshold", "heartbeat.misses"}
    assert found["models[0].kv_cache_dtype"] == ("'int4'", "'fp16' or 'fp8'")
    assert "2m" in found["scheduler.cooldown_period"][1]
    assert "1" in found["scheduler.scale_up_threshold"][1]


def test_missing_required_key():
    found = problems({"site": "t"})
    assert found["models"] == ("nothing", "this key is required")


def test_cross_field_checks_name_both_numbers():
    found = problems(with_("scheduler", {"scale_up_threshold": 0.3, "scale_down_threshold": 0.5}))
    assert any("0.5" in allowed and "0.3" in allowed for _, allowed in found.values())
    data = with_("cluster", {"nodes": 3, "nodelist": "n[1-4]"})
    assert any("4 nodes" in allowed for _, allowed in problems(data).values())


def test_fault_group_must_name_known_nodes():
    data = with_("cluster", {"nodes": 2, "nodelist": "n[1-2]", "fault_groups": {"a": "n[1-3]"}})
    assert any("'n3'" in allowed for _, allowed in problems(data).values())


def test_duplicate_model_names_rejected():
    data = {"site": "t", "models": [{"model_name": "m"}, {"model_name": "m"}]}
    assert any("duplicate" in allowed for _, allowed in problems(data).values())


def test_bad_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("site: x\nmodels: [\n")
    with pytest.raises(ConfigError) as info:
        load_site(path)
    assert info.value.problems[0].path.startswith("line ")


def test_unknown_site_name_lists_known_sites():
    with pytest.raises(ConfigError) as info:
        resolve_site("no-such-site")
    assert "local" in info.value.problems[0].allowed


def test_config_check_cli_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_("models.0.kv_cache_dtype", "int4")))
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "check", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "models[0].kv_cache_dtype" in result.stderr and "'fp16' or 'fp8'" in result.stderr
    good = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "check", "local", "exa256-a100"],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "3072 replica(s)" in good.stdout


def test_config_show_prints_defaults():
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "show", "local"],
                            capture_output=True, text=True, check=True)
    shown = yaml.safe_load(result.stdout)
    assert shown["scheduler"]["cooldown_period"] == 120.0
    assert shown["batching"]["prefill_batch_size"] == 8


def test_the_router_section_reaches_the_policy_and_the_dispatcher():
    from exaserve_hpc.app.routing import dispatch_settings, router_policy
    site = parse_site({"site": "t", "models": [{"model_name": "m"}],
                       "router": {"policy": "prefix_affinity", "block_size": 32, "prefix_mode": "precise",
                                  "index_blocks": 4096, "stall_timeout": "7s", "breaker_failures": 5,
                                  "breaker_cooloff": "3s", "max_attempts": 4, "max_load_factor": 2.5}})
    policy = router_policy(site)
    assert policy.name == "prefix_affinity" and policy.settings.mode == "precise"
    assert policy.settings.max_load_factor == 2.5
    assert policy.settings.block_size == 32 and policy.index.max_blocks == 4096
    assert policy.hasher.scheme.startswith("blake2b8-32x")
    settings = dispatch_settings(site)
    assert settings.stall_limit == 7.0 and settings.max_attempts == 4
    assert settings.breaker.failures == 5 and settings.breaker.cooloff == 3.0
    assert router_policy(parse_site({"site": "t", "models": [{"model_name": "m"}]})).name == "prefix_affinity"


def test_a_controller_timeout_within_two_heartbeats_is_refused():
    base = {"site": "t", "models": [{"model_name": "m"}]}
    with pytest.raises(ConfigError, match="controller_timeout"):
        parse_site({**base, "heartbeat": {"interval": "10s", "controller_timeout": "15s"}})
    assert parse_site({**base, "heartbeat": {"interval": "10s", "controller_timeout": 0}}).heartbeat.controller_timeout == 0
    assert parse_site({**base, "heartbeat": {"interval": "10s", "controller_timeout": "30s"}}).heartbeat.controller_timeout == 30
