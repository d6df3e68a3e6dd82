"""`exaserve status --watch`: a live terminal view of nodes, models, replicas, load and alerts (rich Live).

Each refresh reads the gateway's /v1/exaserve/status (the same JSON `exaserve status` prints). The
alerts panel evaluates the alert rules' conditions (deploy/prometheus/alerts.yml) on that one reading,
here and now: without Prometheus there is no history, so a rule's `for:` duration is not applied (a
queue above 20 shows at once, not after 2 minutes) and rules over rates or windows become their
instantaneous counterparts (restarts so far, not in 15 minutes). The checkpoint, checksum, quota and
etcd-error rules need counters the status does not carry, and one reading sees one controller candidate
(the leader count fires only when the one answering holds no valid lease); the panel names the rules
it does not check. For the real thing, point Prometheus at /metrics with those rules.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

QUEUE_DEPTH_LIMIT = 20       # HighReplicaQueueDepth
HIT_RATE_FLOOR = 0.5         # LowKVCacheHitRate (fleet-wide here: status carries the router's totals)
FLAPPING_RESTARTS = 3        # ReplicaFlapping
# Rules this panel evaluates, and those it cannot (they need counters or every candidate's metrics, which
# one status reading does not carry): together every rule of deploy/prometheus/alerts.yml (tested).
CHECKED = ("NodeLost", "HighReplicaQueueDepth", "ReplicaFlapping", "ReplicaNotReporting", "NoReplicaServingModel",
           "LowKVCacheHitRate", "ControllerLeaderCount")
NOT_CHECKED = ("WeightChecksumFailure", "QuotaExhausted", "ControllerCheckpointFailing", "ControllerCheckpointErrors",
               "ControllerEtcdErrors")
MAX_REPLICA_ROWS = 20        # the busiest replicas; at 3,072 the rest are counted, not listed


def local_alerts(status: dict) -> list[tuple[str, str]]:
    """(rule name, what fires) for the conditions one status reading can show (see the module docstring)."""
    alerts: list[tuple[str, str]] = []
    for a in status.get("agents", []):
        if a.get("state") == "lost":
            alerts.append(("NodeLost", f"node {a['agent_id']} lost (no heartbeat for {a['heartbeat_age']:.0f}s)"))
    for r in status.get("replicas", []):
        if r.get("queue_depth", 0) > QUEUE_DEPTH_LIMIT:
            alerts.append(("HighReplicaQueueDepth",
                           f"{r['replica_id']} on {r.get('node')}: {r['queue_depth']} queued"))
        if r.get("restarts", 0) >= FLAPPING_RESTARTS:
            alerts.append(("ReplicaFlapping",
                           f"{r['replica_id']} restarted {r['restarts']} times: {r.get('detail', '')}"))
        if r.get("state") == "serving" and not r.get("endpoint"):
            alerts.append(("ReplicaNotReporting", f"{r['replica_id']} serves but the router does not route to it"))
    for m in status.get("models", []):
        if m.get("current", 0) == 0 and m.get("min_replicas", 0) > 0:
            alerts.append(("NoReplicaServingModel", f"{m['model']}: none of its {m.get('target', 0)} replicas serves"))
    ha = status.get("ha")
    if ha and not ha.get("acting", True):
        # One reading sees one candidate: the controller answering holds no valid lease (its etcd calls fail,
        # or it is being deposed), so no candidate may be leading. Prometheus counts every candidate.
        alerts.append(("ControllerLeaderCount", f"the controller answering ({ha.get('leader')} on {ha.get('node')}) "
                                                "is not acting as leader: its lease is not valid"))
    router = status.get("router", {})
    hits, queries = router.get("prefix_hit_tokens", 0), router.get("prefix_query_tokens", 0)
    if queries > 0 and hits / queries < HIT_RATE_FLOOR:
        alerts.append(("LowKVCacheHitRate", f"fleet prefix hit rate {hits / queries:.0%}"))
    return alerts


def render(status: dict, url: str, previous: Optional[tuple[float, dict]] = None, now: float = 0.0) -> Group:
    """One frame: header with load, nodes, models, the busiest replicas, alerts. `previous` is the last
    (time, status) seen, for per-second rates."""
    router = status.get("router", {})
    rate = ""
    if previous is not None and now > previous[0]:
        done = router.get("completed", 0) - previous[1].get("router", {}).get("completed", 0)
        rate = f"  {max(0, done) / (now - previous[0]):.1f} req/s"
    header = Text.assemble(
        ("exaserve ", "bold"), f"site {status.get('site')} at {url}  ",
        f"in flight {router.get('inflight', 0)}  pending {router.get('pending', 0)}  "
        f"completed {router.get('completed', 0)}  failed {router.get('failed', 0)}  retries {router.get('retries', 0)}"
        f"{rate}  (refreshed {time.strftime('%H:%M:%S')})")
    nodes = Table(title="nodes", expand=False)
    for column in ("node", "state", "heartbeat", "host memory", "L2", "replicas"):
        nodes.add_column(column)
    replicas = status.get("replicas", [])
    per_node: dict[str, int] = {}
    for r in replicas:
        if r.get("node"):
            per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    for a in status.get("agents", []):
        l2 = a.get("l2") or {}
        nodes.add_row(a["agent_id"], a["state"], f"{a['heartbeat_age']:.1f}s",
                      _fraction(a.get("host_memory_used", 0), a.get("host_memory_total", 0)),
                      _fraction(l2.get("used", 0), l2.get("capacity", 0)), str(per_node.get(a["agent_id"], 0)))
    models = Table(title="models")
    for column in ("model", "serving/target", "min", "load", "last decision"):
        models.add_column(column)
    for m in status.get("models", []):
        models.add_row(m["model"], f"{m['current']}/{m['target']}", str(m["min_replicas"]),
                       "-" if m.get("load") is None else f"{m['load']:.2f}", m.get("decision") or "-")
    busiest = sorted(replicas, key=lambda r: (-(r.get("queue_depth", 0) + r.get("outstanding", 0)), r["replica_id"]))
    shown = busiest[:MAX_REPLICA_ROWS]
    table = Table(title=f"replicas ({len(shown)} busiest of {len(replicas)})" if len(replicas) > len(shown)
                  else "replicas")
    for column in ("replica", "state", "node", "queue", "in flight", "restarts"):
        table.add_column(column)
    for r in shown:
        table.add_row(r["replica_id"], r["state"], str(r.get("node") or "-"), str(r.get("queue_depth", 0)),
                      str(r.get("outstanding", 0)), str(r.get("restarts", 0)))
    alerts = local_alerts(status)
    lines = [Text(f"{name}: {what}", style="red") for name, what in alerts] or [Text("none firing", style="green")]
    lines.append(Text(f"(evaluated on this reading, without the rules' for: durations; not checked here: "
                      f"{', '.join(NOT_CHECKED)}: Prometheus with deploy/prometheus/alerts.yml evaluates those)",
                      style="dim"))
    return Group(header, nodes, models, table, Text("alerts", style="bold"), *lines)


def _fraction(used: int, total: int) -> str:
    return f"{used / total:.0%} of {total / 2**30:.1f} GiB" if total else "-"


def watch(fetch: Callable[[], dict], url: str, interval: float = 2.0, count: Optional[int] = None,
          console: Optional[Console] = None, sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> int:
    """Refresh every `interval` seconds until Ctrl-C (or `count` frames). `fetch` returns the status JSON
    or raises OSError; an unreachable gateway is shown and retried, not fatal."""
    previous: Optional[tuple[float, dict]] = None
    frames = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while count is None or frames < count:
                now = clock()
                try:
                    status = fetch()
                except OSError as exc:
                    live.update(Text(f"cannot reach exaserve at {url}: {getattr(exc, 'reason', exc)}; retrying",
                                     style="red"), refresh=True)
                else:
                    live.update(render(status, url, previous, now), refresh=True)
                    previous = (now, status)
                frames += 1
                if count is None or frames < count:
                    sleep(interval)
        except KeyboardInterrupt:
            pass
    return 0
