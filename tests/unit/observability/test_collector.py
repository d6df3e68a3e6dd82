"""The fleet on /metrics: a real controller (driven through its handler, no sockets) and a real dispatcher
(the router's core, fed the replicas' own stats messages), read by the collector on the real registry.
The values must be the ones the heartbeats and stats reports carried."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exaserve_hpc.app.routing import dispatch_settings, router_policy
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.observability.collector import FLEET, families, render_metrics, sample_fleet
from exaserve_hpc.observability.readings import FleetReadings, ReplicaReading
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, GpuInfo, MemoryPoolStatus, ReplicaEvent, ReplicaHello, ReplicaStats, ReplicaStatus,
    StartReplica
)
from exaserve_hpc.router.dispatch import Dispatcher
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.core import ControllerCore

GiB = 1 << 30


class DispatcherRouter(RouterPortStub):
    """The controller's view of the router (endpoints, snapshot, replica_lost, drain) over a real Dispatcher."""
    backend_endpoint = "tcp://127.0.0.1:1"
    frontend_endpoint = "tcp://127.0.0.1:2"

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    def snapshot(self) -> dict:
        return self.dispatcher.snapshot()

    def replica_lost(self, replica_id: str, why: str) -> None:
        self.dispatcher.replica_lost(replica_id, why, 0.0)

    def drain(self, replica_id: str) -> None:
        pass


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape() -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the registry as /metrics renders it."""
    body, _ = render_metrics()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not on /metrics; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def fleet(tmp_path):
    site = parse_site({
        "site": "obs", "run_dir": str(tmp_path / "run"),
        "cluster": {"nodes": 1, "nodelist": "n1", "gpus_per_node": 2, "gpu_memory": "80GiB"},
        "heartbeat": {"interval": "1s", "misses": 3},
        "weight_cache": {"l3_path": str(tmp_path / "models")},
        "models": [{"model_name": "tiny", "engine": "echo", "replicas": 2, "min_replicas": 2,
                    "gpu_memory_utilization": 0.4}]})
    clock = Clock()
    dispatcher = Dispatcher(router_policy(site), dispatch_settings(site), {"tiny"})
    router = DispatcherRouter(dispatcher)
    ctl = ControllerCore(site, router, clock=clock)
    gpus = [GpuInfo(index=i, name="A100", memory_total=80 * GiB, memory_used=(10 + i) * GiB, utilization=50.0 + i,
                    temperature=60.0, power_watts=200.0) for i in range(2)]
    pool = [80 * GiB] * 2
    ctl.handle("n1", AgentHello(agent_id="n1", hostname="n1", pid=1, gpus=gpus, host_memory_total=512 * GiB,
                                memory=MemoryPoolStatus(block_size=GiB, total=pool, free=pool)))
    started = sorted(m.replica_id for _, m in ctl.fleet.take_outbox() if isinstance(m, StartReplica))
    assert started == ["tiny/r0000", "tiny/r0001"]
    FLEET.watch(ctl, router)
    yield ctl, dispatcher, clock
    FLEET.watch_readings(None)


def test_replica_and_node_figures_are_what_heartbeats_and_stats_carried(fleet):
    ctl, dispatcher, clock = fleet
    ctl.handle("n1", ReplicaEvent(agent_id="n1", replica_id="tiny/r0000", state="serving"))
    dispatcher.on_replica_message("tiny/r0000", ReplicaHello(replica_id="tiny/r0000", model="tiny", pid=42,
                                                             max_batch_size=16, max_seq_len=2048, node="n1"), 1.0)
    dispatcher.on_replica_message("tiny/r0000", ReplicaStats(
        replica_id="tiny/r0000", queue_depth=7, running=3, kv_used=0.25, latency_ewma_ms=120.0, tokens_generated=900,
        requests_finished=11, prefix_hit_tokens=30, prefix_query_tokens=40, kv_blocks_cached=5, ttft_ms_p50=80.0,
        ttft_ms_p99=300.0, tpot_ms_p50=20.0, tpot_ms_p99=40.0), 1.5)
    s = scrape()
    r0 = {"replica": "tiny/r0000", "model": "tiny", "node": "n1"}
    assert value(s, "exaserve_replica_queue_depth", **r0) == 7
    assert value(s, "exaserve_kv_cache_hit_rate", **r0) == pytest.approx(0.75)
    assert value(s, "exaserve_replica_batch_size", **r0) == 3
    assert value(s, "exaserve_kv_cache_usage_ratio", **r0) == 0.25
    assert value(s, "exaserve_replica_latency_seconds", **r0) == pytest.approx(0.12)
    assert value(s, "exaserve_replica_requests_finished_total", **r0) == 11
    assert value(s, "exaserve_replica_generated_tokens_total", **r0) == 900
    assert value(s, "exaserve_replica_time_to_first_token_seconds", quantile="0.99", **r0) == pytest.approx(0.3)
    assert value(s, "exaserve_replica_time_per_output_token_seconds", quantile="0.5", **r0) == pytest.approx(0.02)
    assert value(s, "exaserve_replica_breaker_state", state="closed", **r0) == 1
    assert value(s, "exaserve_replica_state", state="serving", **r0) == 1
    # The other replica is placed but not registered with the router: a state, no engine figures.
    r1 = {"replica": "tiny/r0001", "model": "tiny", "node": "n1"}
    assert value(s, "exaserve_replica_state", state="pending", **r1) == 1
    assert ("exaserve_replica_queue_depth", tuple(sorted(r1.items()))) not in s
    assert value(s, "exaserve_replicas", model="tiny", state="serving") == 1
    assert value(s, "exaserve_model_replicas_serving", model="tiny") == 1
    assert value(s, "exaserve_model_replicas_min", model="tiny") == 2
    assert value(s, "exaserve_gpu_utilization_ratio", node="n1", gpu="1") == pytest.approx(0.51)
    assert value(s, "exaserve_gpu_memory_used_bytes", node="n1", gpu="0") == 10 * GiB
    assert value(s, "exaserve_gpu_power_watts", node="n1", gpu="0") == 200.0
    assert value(s, "exaserve_node_host_memory_total_bytes", node="n1") == 512 * GiB
    assert value(s, "exaserve_node_replicas", node="n1") == 2
    assert value(s, "exaserve_node_up", node="n1") == 1
    assert value(s, "exaserve_nodes", state="alive") == 1
    assert value(s, "exaserve_router_retries_total") == 0


def test_a_silent_node_is_down_with_its_heartbeat_age_and_counted_lost(fleet):
    ctl, _, clock = fleet
    lost_before = scrape().get(("exaserve_nodes_lost_total", ()), 0.0)
    clock.now += 2.0
    assert value(scrape(), "exaserve_heartbeat_age_seconds", node="n1") == pytest.approx(2.0)
    clock.now += ctl.site.heartbeat.expiry
    with ctl.fleet.lock:
        ctl.tick(clock.now)
    s = scrape()
    assert value(s, "exaserve_node_up", node="n1") == 0
    assert value(s, "exaserve_nodes", state="lost") == 1
    assert value(s, "exaserve_nodes_lost_total") == lost_before + 1


def test_weight_load_seconds_by_tier_and_failures_from_replica_events(fleet):
    ctl, _, _ = fleet
    before = scrape()
    count0 = before.get(("exaserve_weight_load_seconds_count", (("tier", "l2"),)), 0.0)
    sum0 = before.get(("exaserve_weight_load_seconds_sum", (("tier", "l2"),)), 0.0)
    failed0 = before.get(("exaserve_replica_failures_total", (("model", "tiny"),)), 0.0)
    ctl.handle("n1", AgentHeartbeat(agent_id="n1", seq=1, replicas=[
        ReplicaStatus(replica_id="tiny/r0000", model="tiny", state="loading", load_source="l2")]))
    ctl.handle("n1", ReplicaEvent(agent_id="n1", replica_id="tiny/r0000", state="loading"))
    ctl.handle("n1", ReplicaEvent(agent_id="n1", replica_id="tiny/r0000", state="initializing",
                                  seconds_in_previous_state=2.5))
    ctl.handle("n1", ReplicaEvent(agent_id="n1", replica_id="tiny/r0001", state="failed", detail="boom"))
    s = scrape()
    assert value(s, "exaserve_weight_load_seconds_count", tier="l2") == count0 + 1
    assert value(s, "exaserve_weight_load_seconds_sum", tier="l2") == pytest.approx(sum0 + 2.5)
    assert value(s, "exaserve_replica_failures_total", model="tiny") == failed0 + 1
    assert value(s, "exaserve_replica_restarts_total", replica="tiny/r0001", model="tiny", node="n1") == 1


def test_watching_twice_counts_each_event_once(fleet):
    ctl, dispatcher, _ = fleet
    FLEET.watch(ctl, DispatcherRouter(dispatcher))
    failed0 = scrape().get(("exaserve_replica_failures_total", (("model", "tiny"),)), 0.0)
    ctl.handle("n1", ReplicaEvent(agent_id="n1", replica_id="tiny/r0000", state="failed", detail="boom"))
    assert value(scrape(), "exaserve_replica_failures_total", model="tiny") == failed0 + 1


def test_an_idle_replica_has_no_hit_rate_and_only_served_replicas_have_engine_series():
    idle = ReplicaReading("m/r0000", "m", "n1", "serving", routed=True)
    names = {f.name: f for f in families(FleetReadings((idle,), (), ()))}
    assert names["exaserve_kv_cache_hit_rate"].samples == []  # no lookups yet: not a low hit rate
    assert len(names["exaserve_replica_queue_depth"].samples) == 1
    per_replica = sum(len(f.samples) for f in families(sample_fleet()) if "replica" in
                      (f.samples[0].labels if f.samples else {}))
    assert per_replica == 19 + 2  # the module docstring's count: 19 series per served replica, 2 per placed one


def test_metrics_gzipped_are_the_same_metrics():
    import gzip
    FLEET.watch_readings(sample_fleet)
    try:
        plain, compressed = render_metrics()[0], render_metrics(gzipped=True)[0]
    finally:
        FLEET.watch_readings(None)
    assert b"exaserve_replica_queue_depth{" in plain and gzip.decompress(compressed) == plain


def test_the_fast_text_writer_says_what_prometheus_client_says():
    from prometheus_client import CollectorRegistry, generate_latest

    from exaserve_hpc.observability.collector import render_text
    from exaserve_hpc.observability.readings import NodeReading
    odd = ReplicaReading('m/r"0\\1\n', "m", "n1", "serving", routed=True, prefix_query_tokens=3,
                         prefix_hit_tokens=1)  # label values that need escaping
    fleet = sample_fleet()
    fleet = FleetReadings(fleet.replicas + (odd,), fleet.nodes + (NodeReading("n2", True, 1e12),), fleet.models,
                          fleet.router, checkpoint=fleet.checkpoint)

    class Fixed:
        def collect(self):
            return families(fleet)

    registry = CollectorRegistry()
    registry.register(Fixed())

    def parsed(text: bytes):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for f in text_string_to_metric_families(text.decode()) for s in f.samples)

    assert parsed(render_text(families(fleet))) == parsed(generate_latest(registry))
    assert ("exaserve_kv_cache_hit_rate", (("model", "m"), ("node", "n1"), ("replica", 'm/r"0\\1\n')),
            pytest.approx(1 / 3)) in parsed(render_text(families(fleet)))
