"""The fleet on /metrics: one prometheus_client Collector that reads the control plane at scrape time.

Rank 0's gateway is the job's one scrape target. Replica and node figures are not pushed anywhere: the
collector calls `readings.read_fleet` on each scrape (the controller's records, kept fresh by the agents'
heartbeats, and the router's per-replica stats reports) and turns the copy into metric families.

Names (the seed's where it names them: `exaserve_replica_queue_depth`, `exaserve_kv_cache_hit_rate`):

per replica, labels {replica, model, node}; ``*`` = only while the router serves it (its engine reports):
  exaserve_replica_state{state}              1 for the replica's current lifecycle state
  exaserve_replica_restarts_total            same-node restarts of this replica id
  exaserve_replica_queue_depth*              requests waiting at the replica
  exaserve_replica_inflight_requests*        requests the router sent it, unfinished
  exaserve_replica_batch_size*               sequences in its running batch (the batch-size distribution
                                             over time and replicas is a histogram_quantile/heatmap of this)
  exaserve_kv_cache_usage_ratio*             fraction of its KV cache in use
  exaserve_kv_cache_hit_rate*                prompt tokens found in its prefix cache / looked up, since it
                                             started; absent until it has looked up any (an idle replica
                                             is not a low hit rate)
  exaserve_replica_prefix_hit_tokens_total*, exaserve_replica_prefix_query_tokens_total*
                                             the same as counters: rate() ratios give a windowed hit rate
  exaserve_replica_kv_blocks_cached*         free KV blocks still holding a reusable prefix
  exaserve_replica_latency_seconds*          its engine's moving average of request latency
  exaserve_replica_requests_finished_total*  rate() = the replica's QPS
  exaserve_replica_generated_tokens_total*   rate() = its tokens per second
  exaserve_replica_time_to_first_token_seconds{quantile}*, exaserve_replica_time_per_output_token_seconds
                                             {quantile}*: p50 and p99 over its engine's recent requests
                                             (engines that measure latency; the gateway's histograms of
                                             the same, per model, are in metrics.py)
  exaserve_replica_breaker_state{state}*     1 for the router's circuit breaker state (closed/open/half_open)
  exaserve_replica_draining*                 1 while the router sends it nothing new
per model {model}: exaserve_replicas{state}, exaserve_model_replicas_serving, _target, _min,
  exaserve_model_pending_requests
per node {node}: exaserve_node_up, exaserve_heartbeat_age_seconds, exaserve_node_host_memory_used_bytes,
  _total_bytes, exaserve_node_replicas, exaserve_node_closed, exaserve_l2_cache_used_bytes, _capacity_bytes,
  exaserve_l2_cache_hits_total, _fills_total, _evictions_total, exaserve_l3_read_bytes_total;
  per GPU {node, gpu} (NVML, from the agents' heartbeats): exaserve_gpu_memory_used_bytes, _total_bytes,
  exaserve_gpu_utilization_ratio, exaserve_gpu_temperature_celsius, exaserve_gpu_power_watts
cluster: exaserve_nodes{state}, exaserve_router_requests_total{outcome}, exaserve_router_retries_total,
  exaserve_router_breaker_opened_total, exaserve_router_decisions_total{reason},
  exaserve_router_token_chunks_total{path}, exaserve_router_chunk_frames_total{path},
  exaserve_router_inflight_requests, exaserve_router_pending_requests, exaserve_replica_moves_in_progress,
  exaserve_oom_unresolved_devices, exaserve_job_restarts, exaserve_checkpoint_age_seconds,
  exaserve_checkpoint_interval_seconds, exaserve_checkpoint_failures_total
Events counted where they happen (failovers, evictions, weight-load failures and durations, quota
refusals, per-token latency) are plain counters and histograms in exaserve_hpc/metrics.py.

Cardinality, bounded by the fleet, never by clients: a served replica is 19 series (15 where its engine
measures no latency), a placed one not yet serving 2; a node is 12 series plus 5 per GPU (52 with 8 GPUs);
a model about 15; the cluster about 30. At the target scale (3,072 replicas on 256 nodes of 8 GPUs)
that is about 58,400 + 13,300 = 71,700 series: benchmarks/bench_metrics_scrape.py measures one scrape of
such a fleet (6.9 MB of text, 0.6 MB as the gateway gzips it for Prometheus; a few hundred ms on 2 cores,
docs/benchmarks.md has the figures), so scrape every 15 s or slower at that scale. Replica ids
are never reused, so a replaced replica's series end and its successor's begin: Prometheus sees churn
proportional to failovers, not to traffic.
"""

from __future__ import annotations

import gzip
import logging
import threading
from typing import Callable, Iterable, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.utils import floatToGoString

from exaserve_hpc import metrics
from exaserve_hpc.observability.readings import (
    CheckpointReading, FleetReadings, GpuReading, ModelReading, NodeReading, ReplicaReading, read_fleet
)

log = logging.getLogger("exaserve.metrics")

REPLICA = ["replica", "model", "node"]
GPU = ["node", "gpu"]
BREAKER_STATES = ("closed", "open", "half_open")


def families(fleet: FleetReadings) -> list:
    """The metric families of one reading (pure: the scrape benchmark calls it on a synthetic fleet)."""
    out: list = []
    out += _replica_families(fleet)
    out += _model_families(fleet)
    out += _node_families(fleet)
    out += _cluster_families(fleet)
    return out


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _replica_families(fleet: FleetReadings) -> list:
    state = _gauge("exaserve_replica_state", "1 for each replica's current lifecycle state.", REPLICA + ["state"])
    restarts = _counter("exaserve_replica_restarts", "Same-node restarts of the replica after it failed.", REPLICA)
    queue = _gauge("exaserve_replica_queue_depth", "Requests waiting at the replica, as its engine last reported.",
                   REPLICA)
    inflight = _gauge("exaserve_replica_inflight_requests",
                      "Requests the router sent to the replica and has not seen finish.", REPLICA)
    batch = _gauge("exaserve_replica_batch_size", "Sequences in the replica's running batch.", REPLICA)
    kv_used = _gauge("exaserve_kv_cache_usage_ratio", "Fraction of the replica's KV cache in use.", REPLICA)
    hit_rate = _gauge("exaserve_kv_cache_hit_rate",
                      "Prompt tokens the replica found in its prefix cache / prompt tokens it looked up, since it "
                      "started (absent until it looked up any).", REPLICA)
    hits = _counter("exaserve_replica_prefix_hit_tokens", "Prompt tokens served from the prefix cache.", REPLICA)
    queries = _counter("exaserve_replica_prefix_query_tokens", "Prompt tokens looked up in the prefix cache.",
                       REPLICA)
    cached = _gauge("exaserve_replica_kv_blocks_cached", "Free KV blocks still holding a reusable prefix.", REPLICA)
    latency = _gauge("exaserve_replica_latency_seconds", "The replica engine's moving average of request latency.",
                     REPLICA)
    finished = _counter("exaserve_replica_requests_finished", "Requests the replica finished (rate: its QPS).",
                        REPLICA)
    tokens = _counter("exaserve_replica_generated_tokens", "Tokens the replica generated.", REPLICA)
    ttft = _gauge("exaserve_replica_time_to_first_token_seconds",
                  "The replica engine's time to first token over its recent requests, by quantile.",
                  REPLICA + ["quantile"])
    tpot = _gauge("exaserve_replica_time_per_output_token_seconds",
                  "The replica engine's time per output token over its recent requests, by quantile.",
                  REPLICA + ["quantile"])
    breaker = _gauge("exaserve_replica_breaker_state", "1 for the router's circuit breaker state of the replica.",
                     REPLICA + ["state"])
    draining = _gauge("exaserve_replica_draining", "1 while the router sends the replica nothing new.", REPLICA)
    for r in fleet.replicas:
        labels = [r.replica_id, r.model, r.node]
        state.add_metric(labels + [r.state], 1)
        restarts.add_metric(labels, r.restarts)
        if not r.routed:
            continue
        queue.add_metric(labels, r.queue_depth)
        inflight.add_metric(labels, r.inflight)
        batch.add_metric(labels, r.running)
        kv_used.add_metric(labels, r.kv_used)
        if r.prefix_query_tokens > 0:
            hit_rate.add_metric(labels, r.prefix_hit_tokens / r.prefix_query_tokens)
        hits.add_metric(labels, r.prefix_hit_tokens)
        queries.add_metric(labels, r.prefix_query_tokens)
        cached.add_metric(labels, r.kv_blocks_cached)
        latency.add_metric(labels, r.latency_ewma_ms / 1000.0)
        finished.add_metric(labels, r.requests_finished)
        tokens.add_metric(labels, r.tokens_generated)
        for family, (p50, p99) in ((ttft, r.ttft_ms), (tpot, r.tpot_ms)):
            if p50 > 0 or p99 > 0:  # engines that measure no latency (echo) report none
                family.add_metric(labels + ["0.5"], p50 / 1000.0)
                family.add_metric(labels + ["0.99"], p99 / 1000.0)
        breaker.add_metric(labels + [r.breaker], 1)
        draining.add_metric(labels, 1 if r.draining else 0)
    return [state, restarts, queue, inflight, batch, kv_used, hit_rate, hits, queries, cached, latency, finished,
            tokens, ttft, tpot, breaker, draining]


def _model_families(fleet: FleetReadings) -> list:
    by_state = _gauge("exaserve_replicas", "Replicas by model and lifecycle state.", ["model", "state"])
    counts: dict[tuple[str, str], int] = {}
    for r in fleet.replicas:
        counts[(r.model, r.state)] = counts.get((r.model, r.state), 0) + 1
    for (model, state), n in sorted(counts.items()):
        by_state.add_metric([model, state], n)
    serving = _gauge("exaserve_model_replicas_serving", "Replicas of the model serving (not draining).", ["model"])
    target = _gauge("exaserve_model_replicas_target", "Replicas of the model wanted now (not stopping).", ["model"])
    minimum = _gauge("exaserve_model_replicas_min", "The model's floor of replicas (site config).", ["model"])
    pending = _gauge("exaserve_model_pending_requests", "Requests the router holds waiting for a replica of the "
                     "model.", ["model"])
    for m in fleet.models:
        serving.add_metric([m.model], m.serving)
        target.add_metric([m.model], m.target)
        minimum.add_metric([m.model], m.minimum)
        pending.add_metric([m.model], m.pending)
    return [by_state, serving, target, minimum, pending]


def _node_families(fleet: FleetReadings) -> list:
    node = ["node"]
    up = _gauge("exaserve_node_up", "1 while the node's agent is heard from, 0 once it is declared lost.", node)
    age = _gauge("exaserve_heartbeat_age_seconds", "Seconds since the controller last heard from the node's agent.",
                 node)
    host_used = _gauge("exaserve_node_host_memory_used_bytes", "Host memory in use on the node.", node)
    host_total = _gauge("exaserve_node_host_memory_total_bytes", "Host memory of the node.", node)
    replicas = _gauge("exaserve_node_replicas", "Replicas placed on the node.", node)
    closed = _gauge("exaserve_node_closed", "1 while placement skips the node (short of memory, or leaving).", node)
    l2_used = _gauge("exaserve_l2_cache_used_bytes", "Bytes of model weights in the node's L2 host cache.", node)
    l2_cap = _gauge("exaserve_l2_cache_capacity_bytes", "Capacity of the node's L2 host cache.", node)
    l2_hits = _counter("exaserve_l2_cache_hits", "Replica starts served from a weight copy already in L2.", node)
    l2_fills = _counter("exaserve_l2_cache_fills", "L3 -> L2 weight copies completed.", node)
    l2_evict = _counter("exaserve_l2_cache_evictions", "Weight copies evicted from L2.", node)
    l3_read = _counter("exaserve_l3_read_bytes", "Bytes the node read from the shared store (L3).", node)
    gpu_used = _gauge("exaserve_gpu_memory_used_bytes", "GPU memory in use (NVML).", GPU)
    gpu_total = _gauge("exaserve_gpu_memory_total_bytes", "GPU memory (NVML).", GPU)
    gpu_util = _gauge("exaserve_gpu_utilization_ratio", "GPU utilisation, 0..1 (NVML).", GPU)
    gpu_temp = _gauge("exaserve_gpu_temperature_celsius", "GPU temperature (NVML).", GPU)
    gpu_power = _gauge("exaserve_gpu_power_watts", "GPU power draw (NVML).", GPU)
    for n in fleet.nodes:
        labels = [n.node]
        up.add_metric(labels, 0 if n.lost else 1)
        age.add_metric(labels, n.heartbeat_age)
        host_used.add_metric(labels, n.host_memory_used)
        host_total.add_metric(labels, n.host_memory_total)
        replicas.add_metric(labels, n.replicas)
        closed.add_metric(labels, 1 if n.closed else 0)
        l2_used.add_metric(labels, n.l2_used)
        l2_cap.add_metric(labels, n.l2_capacity)
        l2_hits.add_metric(labels, n.l2_hits)
        l2_fills.add_metric(labels, n.l2_fills)
        l2_evict.add_metric(labels, n.l2_evictions)
        l3_read.add_metric(labels, n.l3_bytes_read)
        for g in n.gpus:
            gl = [n.node, str(g.index)]
            gpu_used.add_metric(gl, g.memory_used)
            gpu_total.add_metric(gl, g.memory_total)
            gpu_util.add_metric(gl, g.utilization / 100.0)
            gpu_temp.add_metric(gl, g.temperature)
            gpu_power.add_metric(gl, g.power_watts)
    return [up, age, host_used, host_total, replicas, closed, l2_used, l2_cap, l2_hits, l2_fills, l2_evict, l3_read,
            gpu_used, gpu_total, gpu_util, gpu_temp, gpu_power]


def _cluster_families(fleet: FleetReadings) -> list:
    router = fleet.router
    nodes = _gauge("exaserve_nodes", "Nodes whose agents joined, by state (alive, lost).", ["state"])
    lost = sum(n.lost for n in fleet.nodes)
    nodes.add_metric(["alive"], len(fleet.nodes) - lost)
    nodes.add_metric(["lost"], lost)
    requests = _counter("exaserve_router_requests", "Requests the router accepted, completed and failed.",
                        ["outcome"])
    for outcome in ("accepted", "completed", "failed"):
        requests.add_metric([outcome], router.get(outcome, 0))
    out = [nodes, requests]
    for name, key, doc in (
            ("exaserve_router_retries", "retries", "Requests the router re-sent to another replica."),
            ("exaserve_router_breaker_opened", "breaker_opened", "Times a replica's circuit breaker opened.")):
        family = _counter(name, doc)
        family.add_metric([], router.get(key, 0))
        out.append(family)
    chunks = _counter("exaserve_router_token_chunks", "Token chunks the router passed on, by path "
                      "(from_replicas, to_gateways).", ["path"])
    frames = _counter("exaserve_router_chunk_frames", "Frames that carried them (one TokenChunks frame holds "
                      "several): chunks per frame is what batching saves the router's thread.", ["path"])
    for path in ("from_replicas", "to_gateways"):
        chunks.add_metric([path], router.get(f"chunks_{path}", 0))
        frames.add_metric([path], router.get(f"chunk_frames_{path}", 0))
    out += [chunks, frames]
    decisions = _counter("exaserve_router_decisions", "Routing decisions by the policy's reason.", ["reason"])
    for reason, n in sorted(router.get("routing", {}).items()):
        decisions.add_metric([reason], n)
    out.append(decisions)
    for name, value, doc in (
            ("exaserve_router_inflight_requests", router.get("inflight", 0), "Requests in the router, unfinished."),
            ("exaserve_router_pending_requests", router.get("pending", 0), "Requests waiting for any replica."),
            ("exaserve_replica_moves_in_progress", fleet.moves, "Replica moves (rebalancing, leaves) under way."),
            ("exaserve_oom_unresolved_devices", fleet.oom_unresolved,
             "Devices short of memory the OOM guard could not relieve."),
            ("exaserve_job_restarts", fleet.job_restarts, "Requeues this job has been through.")):
        family = _gauge(name, doc)
        family.add_metric([], value)
        out.append(family)
    if fleet.checkpoint is not None:
        c = fleet.checkpoint
        for name, value, doc in (
                ("exaserve_checkpoint_age_seconds", c.age_seconds,
                 "Seconds since the controller state was last written (since start when never)."),
                ("exaserve_checkpoint_interval_seconds", c.interval,
                 "requeue.checkpoint_interval (0: no periodic writes).")):
            family = _gauge(name, doc)
            family.add_metric([], value)
            out.append(family)
        failures = _counter("exaserve_checkpoint_failures", "Failed attempts to write the controller state.")
        failures.add_metric([], c.failures)
        out.append(failures)
    return out


class FleetCollector:
    """One per process (FLEET, rendered by render_metrics after the registry); `watch` points it at
    this process's control plane. A prometheus_client Collector too (collect/describe), for other registries."""

    def __init__(self) -> None:
        self._source: Optional[Callable[[], FleetReadings]] = None
        self._lock = threading.Lock()

    def watch(self, controller, router, keeper=None) -> None:
        with self._lock:
            self._source = lambda: read_fleet(controller, router, keeper)
        _hook_replica_events(controller)

    def watch_readings(self, source: Optional[Callable[[], FleetReadings]]) -> None:
        """Any source of readings (tests, the benchmark); None: none (only the event metrics are served)."""
        with self._lock:
            self._source = source

    def describe(self) -> list:
        return []  # names vary with the fleet; do not make the registry collect at registration

    def collect(self):
        with self._lock:
            source = self._source
        if source is None:
            return []
        try:
            return families(source())
        except Exception:  # noqa: BLE001 - a broken reading must not take the gateway's counters down with it
            log.exception("reading the fleet for /metrics failed")
            return []

    def render(self) -> bytes:
        """The fleet's families in the text format (render_metrics appends them to the registry's)."""
        return render_text(self.collect())


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def render_text(fams: list) -> bytes:
    """Prometheus text format 0.0.4, as prometheus_client's generate_latest writes it but without its
    per-sample label-name validation: these families' label names are the constants above (3x faster at
    3,072 replicas, bench_metrics_scrape.py)."""
    out: list[str] = []
    for family in fams:
        name = family.name + "_total" if family.type == "counter" else family.name
        out.append(f"# HELP {name} {family.documentation}\n# TYPE {name} {family.type}\n")
        for s in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
            out.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}\n" if labels
                       else f"{s.name} {floatToGoString(s.value)}\n")
    return "".join(out).encode()


def _hook_replica_events(controller) -> None:
    """Weight-load durations and replica failures, counted from the controller's replica-event hook."""
    previous = controller.on_replica_state
    if getattr(previous, "exaserve_metrics", False):
        previous = None  # watched before: replace our own hook, do not count twice

    def on_state(record) -> None:
        state = record.state.value
        if state == "initializing" and record.transitions and record.transitions[-1][0] == "initializing":
            # Leaving "loading": its seconds are the weight load, from the tier the agent reported.
            metrics.WEIGHT_LOAD_SECONDS.labels(record.load_source or "none").observe(record.transitions[-1][1])
        elif state == "failed":
            metrics.REPLICA_FAILURES.labels(record.model).inc()
        if previous is not None:
            previous(record)

    on_state.exaserve_metrics = True
    controller.on_replica_state = on_state


FLEET = FleetCollector()  # the fleet's per-replica, per-node and cluster figures, read at scrape time


def render_metrics(gzipped: bool = False) -> tuple[bytes, str]:
    """/metrics: the registry (metrics.py) and the fleet in Prometheus text exposition format: (body, content
    type). The fleet is not on the registry: FLEET writes it with its own, faster text writer."""
    body = generate_latest(metrics.REGISTRY) + FLEET.render()
    return (gzip.compress(body, 1) if gzipped else body), CONTENT_TYPE_LATEST


def watch_fleet(controller, router, keeper=None) -> None:
    """Serve this control plane's fleet on /metrics (one per process; a later call replaces it)."""
    FLEET.watch(controller, router, keeper)


def sample_fleet() -> FleetReadings:
    """A fleet with every optional part present (a routed replica with prefix lookups, one not routed,
    a node with a GPU, a checkpoint keeper): what `exported_names` renders."""
    return FleetReadings(
        (ReplicaReading("m/r0000", "m", "n1", "serving", routed=True, prefix_query_tokens=1, ttft_ms=(1.0, 2.0),
                        tpot_ms=(1.0, 2.0)),
         ReplicaReading("m/r0001", "m", "", "pending")),
        (NodeReading("n1", False, 0.1, gpus=(GpuReading(0, 1, 0, 0.0, 0.0, 0.0),)),),
        (ModelReading("m", 1, 2, 1),), {"routing": {"least_load": 1}}, checkpoint=CheckpointReading(0.0, 1.0, 0))


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def exported_names() -> set[str]:
    """Every sample name /metrics can carry (the gateway's, the events' and the fleet's), e.g. for checking
    that dashboards and alert rules name only real series."""
    fams = list(metrics.REGISTRY.collect()) + families(sample_fleet())
    return {f.name + suffix for f in fams for suffix in _SUFFIXES.get(f.type, ("",))}
