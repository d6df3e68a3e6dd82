"""Prometheus metrics for the gateway, router and controller.

Everything registers on one module-level ``REGISTRY`` instead of
prometheus_client's global default: a process may build several gateway apps
(tests do, one per fixture) and the default registry refuses to register a
metric name twice. ``render()`` is what ``/metrics`` serves.

Label values must come from bounded sets (served model names, fixed endpoint
and cause names, node names of the allocation); never put a client-supplied
string into a label, or a typo-ing client grows the series without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

# Latency buckets from a loopback echo (a few ms) up to long generations (minutes).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# ------------------------------------------------------------ gateway

REQUESTS = Counter(
    "exaserve_requests_total",
    "HTTP API requests answered, by served model ('unknown' when none matched), endpoint and HTTP status.",
    ["model", "endpoint", "status"],
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "exaserve_request_seconds",
    "Wall time from request arrival to the last byte of the answer.",
    ["model", "endpoint"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "exaserve_time_to_first_token_seconds",
    "Wall time from request arrival to the first generated token reaching the gateway.",
    ["model"],
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "exaserve_generated_tokens_total",
    "Completion tokens received from replicas.",
    ["model"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "exaserve_prompt_tokens_total",
    "Prompt tokens of admitted requests.",
    ["model"],
    registry=REGISTRY,
)
INFLIGHT_REQUESTS = Gauge(
    "exaserve_inflight_requests",
    "Generation requests admitted by the gateway and not yet answered.",
    registry=REGISTRY,
)

# ------------------------------------------------------------ router / controller

REPLICAS = Gauge(
    "exaserve_replicas",
    "Replicas by model and lifecycle state.",
    ["model", "state"],
    registry=REGISTRY,
)
ROUTER_RETRIES = Counter(
    "exaserve_router_retries_total",
    "Requests the router re-sent to another replica, by cause (replica_failed, timeout, node_lost, ...).",
    ["model", "cause"],
    registry=REGISTRY,
)
NODES = Gauge(
    "exaserve_nodes",
    "Nodes of the allocation by state.",
    ["state"],
    registry=REGISTRY,
)
HEARTBEAT_AGE = Gauge(
    "exaserve_heartbeat_age_seconds",
    "Seconds since the controller last heard from each node agent.",
    ["node"],
    registry=REGISTRY,
)


def render() -> tuple[bytes, str]:
    """The registry in Prometheus text exposition format: (body, content type)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
