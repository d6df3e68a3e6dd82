"""Autoscaler: per-model replica targets from load, with thresholds, a floor and a cooldown.

Call protocol: every tick the controller builds one ModelLoad per model from
telemetry and calls ``Autoscaler.tick(loads, now)`` (or the pure
``autoscale(loads, policy, history, now)``); it gets one ScaleDecision per
model, each labelled with its reason, and applies the changes with
``apply_scaling``. `now` is seconds on any monotonic clock the caller owns.

Policy:
- load = queue depth / (replicas x requests one replica serves at once);
- load > scale_up_threshold: scale up to the count that brings load to the
  middle of the band [down, up]; load < scale_down_threshold: scale down
  likewise, never below the model's min replicas;
- fewer replicas than the minimum: scale up to it at once (a floor, not a
  load decision: no cooldown);
- replicas still starting: no scale-down (the serving count is not settled,
  e.g. mid-failover, and a removal now could undo the start under way);
- cooldown: a scale-down waits cooldown_period after the last scale-up, and
  goes no lower than the most replicas the load asked for over the last
  cooldown_period (the window's peak, so a trough's lull does not cut the
  fleet the next ramp needs); a scale-up never waits: a scale-down that
  proved too deep is undone at once, not after a cooldown while queues grow
  (replicas take tens of seconds to serve). Flapping stays bounded: after
  any scale-up, a cooldown_period passes before the next scale-down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.topology import Topology
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.occupancy import Occupancy
from exaserve_hpc.controller.placement import Placer, shape_problem
from exaserve_hpc.controller.plan import Assignment, Plan, Unplaced, replica_id, replica_index

UP, HOLD, DOWN = 1, 0, -1


@dataclass(frozen=True)
class ModelLoad:
    model: str
    replicas: int  # replicas serving now
    queue_depth: float  # requests queued or running across them
    capacity_per_replica: float  # requests one replica serves at once (its max batch size)
    starting: int = 0  # replicas placed but not serving yet (they count once they serve)

    @property
    def load(self) -> float:
        if self.replicas <= 0:
            return math.inf if self.queue_depth > 0 else 0.0
        return self.queue_depth / (self.replicas * self.capacity_per_replica)


@dataclass(frozen=True)
class AutoscalePolicy:
    scale_up_threshold: float = 0.75
    scale_down_threshold: float = 0.25
    cooldown_period: float = 120.0
    default_min_replicas: int = 4
    min_replicas: Mapping[str, int] = field(default_factory=dict)  # per model; else default_min_replicas

    def __post_init__(self) -> None:
        if not 0 <= self.scale_down_threshold < self.scale_up_threshold:
            raise ValueError(f"scale_down_threshold ({self.scale_down_threshold}) must be >= 0 and below "
                             f"scale_up_threshold ({self.scale_up_threshold})")

    @property
    def target_load(self) -> float:
        return (self.scale_up_threshold + self.scale_down_threshold) / 2

    def floor(self, model: str) -> int:
        return self.min_replicas.get(model, self.default_min_replicas)

    @classmethod
    def from_site(cls, site: SiteConfig) -> "AutoscalePolicy":
        sched = site.scheduler
        return cls(sched.scale_up_threshold, sched.scale_down_threshold, sched.cooldown_period,
                   sched.min_replicas_per_model, {m.model_name: site.min_replicas(m) for m in site.models})


@dataclass(frozen=True)
class ScaleDecision:
    model: str
    current: int
    target: int
    load: float
    reason: str
    wanted: int = 0  # replicas this tick's load asks for (the middle of the band); kept for the window's peak

    @property
    def delta(self) -> int:
        return self.target - self.current

    @property
    def direction(self) -> int:
        return (self.delta > 0) - (self.delta < 0)


@dataclass(frozen=True)
class ScalingHistory:
    """model -> {direction: time of the last scaling in that direction}; and model -> the replicas the load
    asked for lately, as (time, wanted) with wanted strictly falling (a sliding-window maximum: the first
    entry still inside the window is its peak)."""
    last: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    asked: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)

    def last_at(self, model: str, direction: int) -> float | None:
        return self.last.get(model, {}).get(direction)

    def peak_since(self, model: str, since: float) -> int:
        """The most replicas the load asked for at or after `since` (0: nothing recorded)."""
        return next((w for t, w in self.asked.get(model, ()) if t >= since), 0)

    def record(self, decisions: Iterable[ScaleDecision], now: float, window: float = math.inf) -> "ScalingHistory":
        decisions = list(decisions)
        asked = dict(self.asked)
        for d in decisions:
            kept = tuple(e for e in asked.get(d.model, ()) if e[0] >= now - window and e[1] > d.wanted)
            asked[d.model] = kept + ((now, d.wanted),)
        changed = {d.model: d.direction for d in decisions if d.direction != HOLD}
        last = dict(self.last)
        for model, direction in changed.items():
            last[model] = {**last.get(model, {}), direction: now}
        return ScalingHistory(last, asked)


def _wanted(load: ModelLoad, target_load: float) -> int:
    return math.ceil(load.queue_depth / (load.capacity_per_replica * target_load) - 1e-9)


def decide(load: ModelLoad, policy: AutoscalePolicy, history: ScalingHistory, now: float) -> ScaleDecision:
    """One model's decision; see the module docstring for the policy."""
    floor, n, x = policy.floor(load.model), load.replicas, load.load
    up, down = policy.scale_up_threshold, policy.scale_down_threshold

    wanted = _wanted(load, policy.target_load)

    def hold(reason: str) -> ScaleDecision:
        return ScaleDecision(load.model, n, n, x, f"hold: {reason}", wanted)

    if n < floor:
        target = max(floor, wanted) if x > up else floor
        return ScaleDecision(load.model, n, target, x, f"below min_replicas: {n} < {floor}, {n} -> {target}", wanted)
    if x > up:
        target = max(n + 1, wanted)
        return ScaleDecision(load.model, n, target, x, f"load {x:.2f} > scale_up_threshold {up}: {n} -> {target} "
                                                       f"replicas for load ~{policy.target_load:.2f}", wanted)
    if x >= down:
        return hold(f"load {x:.2f} within [{down}, {up}]")
    label = f"load {x:.2f} < scale_down_threshold {down}"
    if max(floor, min(n - 1, wanted)) >= n:
        return hold(f"{label} but at min_replicas {floor}")
    if load.starting:
        return hold(f"{label} but {load.starting} replica(s) still starting")
    scaled_up = history.last_at(load.model, UP)
    if scaled_up is not None and now - scaled_up < policy.cooldown_period:
        wait = policy.cooldown_period - (now - scaled_up)
        return hold(f"{label}, but cooldown: scaled up {now - scaled_up:.0f}s ago, scaling down waits {wait:.0f}s more")
    peak = history.peak_since(load.model, now - policy.cooldown_period)
    target = max(floor, min(n - 1, wanted), min(n, peak))
    if target >= n:
        return hold(f"{label}, but the last {policy.cooldown_period:.0f}s peaked at {peak} replicas' worth")
    return ScaleDecision(load.model, n, target, x, f"{label}: {n} -> {target} replicas for load ~"
                         f"{policy.target_load:.2f}" + (f" (the last {policy.cooldown_period:.0f}s' peak)"
                                                        if peak > wanted else ""), wanted)


def autoscale(loads: Iterable[ModelLoad], policy: AutoscalePolicy, history: ScalingHistory, now: float
              ) -> tuple[list[ScaleDecision], ScalingHistory]:
    decisions = [decide(load, policy, history, now) for load in loads]
    return decisions, history.record(decisions, now, policy.cooldown_period)


class Autoscaler:
    """Holds the policy and the scaling history between ticks; decisions are pure."""

    def __init__(self, policy: AutoscalePolicy, history: ScalingHistory | None = None):
        self.policy = policy
        self.history = history or ScalingHistory()

    def tick(self, loads: Iterable[ModelLoad], now: float) -> list[ScaleDecision]:
        decisions, self.history = autoscale(loads, self.policy, self.history, now)
        return decisions


@dataclass
class ScalingResult:
    plan: Plan
    started: list[Assignment] = field(default_factory=list)
    stopped: list[Assignment] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)


def apply_scaling(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec],
                  decisions: Iterable[ScaleDecision], max_replicas_per_node: int) -> ScalingResult:
    """Turn decisions into a new plan: new replicas via the placer (ids continue the model's
    numbering); removals from the fault group with the most replicas of the model, then the
    busiest node, newest replica first, so the spread and node headroom improve."""
    decisions = sorted(decisions, key=lambda d: d.delta)  # removals first: their room serves the additions
    occ = Occupancy.from_plan(topology, plan, max_replicas_per_node)
    placer = Placer(occ)
    result = ScalingResult(plan)
    for d in decisions:
        spec = catalogue[d.model]
        current = [a for a in occ.assignments.values() if a.model == d.model]
        if d.target > len(current):
            start = plan.next_index(d.model)
            rids = [replica_id(d.model, start + k) for k in range(d.target - len(current))]
            placed, missing = placer.place_many(spec, rids, shape_problem(spec, topology))
            result.started += placed
            result.unplaced += missing
        for _ in range(max(0, len(current) - d.target)):
            victim = max(current, key=lambda a: (
                occ.model_count(d.model, occ.node_group[topology.node(a.node).index]),
                occ.count[topology.node(a.node).index], replica_index(a.replica_id)))
            occ.release(victim)
            current.remove(victim)
            result.stopped.append(victim)
            placer.reset()  # capacity grew: nodes dropped from the heaps may fit again
    decided = {d.model for d in decisions}
    carried = [u for u in plan.unplaced if u.model not in decided]  # a new target supersedes old shortfalls
    result.plan = occ.to_plan(plan.site, [a.replica_id for a in plan.assignments], carried + result.unplaced)
    return result
