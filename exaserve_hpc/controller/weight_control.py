"""Model weights on the controller's side: where a replica goes when its weights will not load, and
which models each node loads into its L2 before they are asked for.

- load failover: an agent reports LoadFailed for a replica; `after_load_failure` (agent/load_failover.py)
  picks another live node with room that has not failed it yet, or none (a bad shared-store copy fails
  everywhere), and the replica is started there or left failed. A prefetch that failed is only logged.
- L2 prefetch: on each demand sample the controller hands the demand history to `prefetch_plan`
  (cache/prefetch.py) per live node and sends a Prefetch for each model the plan fills. A model asked for
  is not asked for again on that node until a heartbeat has had time to show it in the node's L2.

Decisions are the pure functions; `WeightControl` carries them out on the controller thread, holding the
fleet's lock: the replica goes to the chosen node where the planner finds it a slot there
(`PlacementControl.place_on`), else wherever the planner puts it, avoiding the nodes that failed it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from exaserve_hpc import metrics
from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.agent.load_failover import NodeView, after_load_failure
from exaserve_hpc.cache.l3_store import manifest_bytes
from exaserve_hpc.cache.manifest import CheckpointError
from exaserve_hpc.cache.prefetch import prefetch_plan
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.registry import engine_spec
from exaserve_hpc.protocol import LoadFailed, Prefetch

if TYPE_CHECKING:
    from exaserve_hpc.controller.fleet import Fleet
    from exaserve_hpc.controller.placement_control import PlacementControl

log = logging.getLogger("exaserve.controller")  # these lines were the controller's; their logger stays


def model_bytes(site: SiteConfig) -> dict[str, int]:
    """Checkpoint size per model with weights in the shared store (engines without weights have none)."""
    sizes = {}
    for model in site.models:
        if not engine_spec(model.engine).needs_weights:
            continue
        try:
            sizes[model.model_name] = manifest_bytes(site.model_dir(model))
        except (CheckpointError, OSError, ValueError):
            continue  # no checkpoint yet: nothing to prefetch
    return sizes


class WeightControl:
    """Load failover and L2 prefetch; the controller calls `on_load_failed` and `prefetch` on its thread."""

    def __init__(self, fleet: "Fleet", placement: "PlacementControl"):
        self.fleet = fleet
        self.placement = placement

    def on_load_failed(self, agent_id: str, failed: LoadFailed) -> None:
        """Weights would not load on `agent_id`: start the replica on another node, or leave it failed."""
        fleet = self.fleet
        metrics.WEIGHT_LOAD_FAILURES.labels(failed.model, failed.reason).inc()
        if not failed.replica_id:
            log.warning("prefetch of %s on %s failed (%s): %s", failed.model, agent_id, failed.reason, failed.detail)
            return
        record = fleet.replicas.get(failed.replica_id)
        if record is None or record.agent_id != agent_id:
            return
        if record.stopping:  # scaled down while it loaded: nothing to move
            fleet.forget(record, "scaled down, weights did not load")
            return
        record.tried_agents.add(agent_id)
        needed = record.assignment.bytes_per_gpu if record.assignment is not None else 0  # what the plan reserves
        decision = after_load_failure(failed, self._live_nodes(), record.tried_agents, needed)
        record.restart_at = 0.0  # the failover decides, not the same-node restart
        if decision.agent_id is None:
            record.assignment = None  # its reservation is gone; it stays listed on the node that failed last
            record.state = ReplicaState.FAILED
            record.detail = record.given_up = f"weights did not load: {decision.why}"
            log.error("replica %s stays failed: %s", record.replica_id, decision.why)
            return
        log.warning("replica %s: load failed on %s; starting it on %s (%s)", record.replica_id, agent_id,
                    decision.agent_id, decision.why)
        self.placement.place_on(record, decision.agent_id, f"weights did not load on {agent_id}")

    def _live_nodes(self) -> list[NodeView]:
        """A view of each live node with the number of unfinished replicas placed on it."""
        counts: dict[str, int] = {}
        for r in self.fleet.replicas.values():
            if r.agent_id is not None and not r.state.terminal:
                counts[r.agent_id] = counts.get(r.agent_id, 0) + 1
        return [a.view(counts.get(a.agent_id, 0)) for a in self.fleet.live_agents()]

    def prefetch(self, now: float, demand, demand_interval: float) -> None:
        """Ask each live node to load into L2 the models its demand forecast wants (cache/prefetch.py)."""
        fleet = self.fleet
        site = fleet.site
        sizes = model_bytes(site)
        history = demand.history()
        quiet = max(3 * site.heartbeat.interval, 2 * demand_interval)  # until a heartbeat shows it
        for agent in fleet.agents.values():
            if agent.lost or agent.l2 is None:
                continue
            recent = {m for m, at in agent.prefetch_sent.items() if now - at < quiet}
            wanted = {m: h for m, h in history.items() if m not in recent}
            for action in prefetch_plan(wanted, agent.l2, sizes):
                log.info("prefetch %s into L2 of %s (forecast %.1f requests/interval, evicts %s)", action.model,
                         agent.agent_id, action.forecast, list(action.evicts) or "nothing")
                agent.prefetch_sent[action.model] = now
                fleet.send(agent.agent_id, Prefetch(model=action.model,
                                                    model_dir=str(site.model_dir(site.model(action.model)))))
