"""Prometheus metrics for the gateway, router and controller.

Two kinds: counters and histograms of events, incremented where they happen (gateway requests, quota
refusals, nodes lost, OOM evictions, weight-load failures and durations); and the fleet's state
(per replica, per node, per model, the router's counters), which ``collector.FLEET`` reads from the controller
and the router at scrape time once ``watch_fleet`` has pointed it at them (observability/collector.py
lists every name and the cardinality).

Everything registers on one module-level ``REGISTRY`` instead of
prometheus_client's global default: a process may build several gateway apps
(tests do, one per fixture) and the default registry refuses to register a
metric name twice. ``observability/collector.render_metrics`` is what ``/metrics`` serves.

Label values must come from bounded sets (served model names, fixed endpoint
and cause names, node names of the allocation); never put a client-supplied
string into a label, or a typo-ing client grows the series without bound.
"""

from __future__ import annotations


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

# ------------------------------------------------------------ events
# Things that happen between scrapes, counted where they happen. Everything that is a *state* (replica
# queue depth, node telemetry, breaker state, replicas per state) is read from the controller and the
# router at scrape time instead: see exaserve_hpc/observability/collector.py, registered below.

TIME_PER_OUTPUT_TOKEN = Histogram(
    "exaserve_time_per_output_token_seconds",
    "Per finished request with two or more completion tokens: (last token - first token) / (tokens - 1), "
    "as the gateway received them.",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
# Per quota group: label values come from the site config (quota_groups[].name and .account; 'none' and ''
# for callers without a group) and the served model names, never from a request.
GROUP = ["group", "account", "model"]
QUOTA_REJECTIONS = Counter(
    "exaserve_quota_rejections_total",
    "Requests refused with 429 because their quota group was at a limit, by reason (limit: "
    "max_concurrent_requests, tokens_per_minute, burst_ceiling, borrowing_preempted, fair_share).",
    ["group", "account", "model", "limit"],
    registry=REGISTRY,
)
GROUP_REQUESTS = Counter(
    "exaserve_group_requests_total",
    "Generation requests admitted and ended (any outcome), by quota group, its Slurm account and model.",
    GROUP,
    registry=REGISTRY,
)
GROUP_PROMPT_TOKENS = Counter(
    "exaserve_group_prompt_tokens_total",
    "Prompt tokens of finished requests that produced tokens (what the usage ledger bills), by quota group, "
    "account and model.",
    GROUP,
    registry=REGISTRY,
)
GROUP_COMPLETION_TOKENS = Counter(
    "exaserve_group_completion_tokens_total",
    "Completion tokens of finished requests (what the usage ledger bills), by quota group, account and model.",
    GROUP,
    registry=REGISTRY,
)
GROUP_SHARE_USED = Gauge(
    "exaserve_group_share_used_ratio",
    "The quota group's requests in flight on the model over the model's request slots (replicas x batch "
    "slots): compare with exaserve_group_share_ratio's guaranteed and burst shares.",
    GROUP,
    registry=REGISTRY,
)
GROUP_SHARE = Gauge(
    "exaserve_group_share_ratio",
    "The quota group's configured share of each model's slots (kind: guaranteed_share or burst_share).",
    ["group", "account", "kind"],
    registry=REGISTRY,
)
GROUP_TOKENS = Counter(
    "exaserve_group_tokens_total",
    "Prompt + completion tokens of finished requests, by quota group ('none' for callers without one).",
    ["group"],
    registry=REGISTRY,
)
GROUP_INFLIGHT = Gauge(
    "exaserve_group_inflight_requests",
    "Generation requests admitted and not yet answered, by quota group ('none' for callers without one).",
    ["group"],
    registry=REGISTRY,
)
NODES_LOST = Counter(
    "exaserve_nodes_lost_total",
    "Times the controller declared a node lost (heartbeat.misses silent heartbeat intervals); its replicas "
    "are then placed elsewhere (a failover).",
    registry=REGISTRY,
)

CONTROLLER_ORDERS = Counter(
    "exaserve_controller_orders_total",
    "Orders the controller sent to node agents, by kind (StartReplica, StopReplica, Prefetch, Shutdown, "
    "StageTable; heartbeat acknowledgements are not orders): a start storm or a stop loop shows here.",
    ["order"],
    registry=REGISTRY,
)
OOM_EVICTIONS = Counter(
    "exaserve_oom_evictions_total",
    "Replicas the OOM guard stopped because their node ran short of device memory.",
    ["model"],
    registry=REGISTRY,
)
WEIGHT_LOAD_FAILURES = Counter(
    "exaserve_weight_load_failures_total",
    "Replica weight loads that failed on a node, by reason (checksum, load_timeout, checkpoint, l2_full, io).",
    ["model", "reason"],
    registry=REGISTRY,
)
WEIGHT_LOAD_SECONDS = Histogram(
    "exaserve_weight_load_seconds",
    "Seconds replicas spent loading weights, by the tier they came from (l2: host cache, l3: shared store).",
    ["tier"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
REPLICA_FAILURES = Counter(
    "exaserve_replica_failures_total",
    "Replica processes that reported failed, by model.",
    ["model"],
    registry=REGISTRY,
)

# ------------------------------------------------------------ controller HA (ha.etcd; exaserve_hpc/ha/election.py)
# One series per controller candidate in the process (candidate: "rankN@NODE", bounded by ha.candidates).
# Only processes with a gateway serve them: the leader's plane, and rank k < router.count's gateway k.
HA = ["candidate", "node"]
HA_LEADER = Gauge(
    "exaserve_ha_leader",
    "1 while this candidate leads the controller election and its lease is surely alive, else 0.",
    HA,
    registry=REGISTRY,
)
HA_ELECTIONS = Counter(
    "exaserve_ha_elections_total",
    "Times this candidate won the controller election.",
    HA,
    registry=REGISTRY,
)
HA_LEASE_SECONDS_LEFT = Gauge(
    "exaserve_ha_lease_seconds_left",
    "Seconds until the leader must stop acting unless a renewal lands (its lease TTL less the safety margin, "
    "from the last renewal it sent); 0 on a standby.",
    HA,
    registry=REGISTRY,
)
HA_FENCED_WRITES_REFUSED = Counter(
    "exaserve_ha_fenced_writes_refused_total",
    "Writes etcd refused because the writer's election key was gone or another candidate's (a deposed leader).",
    HA,
    registry=REGISTRY,
)
HA_ETCD_ERRORS = Counter(
    "exaserve_ha_etcd_errors_total",
    "etcd calls that failed, by kind (unavailable: no member could serve it; refused: a member refused the "
    "request itself).",
    ["kind"],
    registry=REGISTRY,
)
