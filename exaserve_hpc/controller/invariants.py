"""Every placement invariant, checked from scratch on a finished Plan.

Written independently of the placer (plain loops, no shared bookkeeping) so
tests and the controller can audit any plan a policy returns. Each problem is
one readable line; an empty list means the plan is sound.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from exaserve_hpc.topology import Topology
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.plan import Plan

FRACTION_SLACK = 1e-9


def _group_can_host(plan: Plan, topology: Topology, spec: ModelSpec, group: str, cap: int,
                    free: dict[str, list[int]], per_node: Counter) -> bool:
    """Could `group` take one more replica of `spec` in the plan's final state? (brute force)"""
    hosts = 0
    for name in topology.group(group).nodes:
        node = topology.node(name)
        if name in plan.down_nodes or per_node[name] >= cap:
            continue
        for domain in node.nvlink_domains:
            ok = 0
            for d in domain:
                claim = spec.reservation(node.devices[d])
                if free[name][d] >= claim and spec.need_per_device <= claim:
                    ok += 1
            if ok >= spec.tensor_parallel:
                hosts += 1
                break
    return hosts >= spec.pipeline_parallel


def plan_violations(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec],
                    max_replicas_per_node: int, spread: bool = True) -> list[str]:
    """Every broken invariant of `plan`, one line each.

    `spread=False` skips the fault-group spread check: after failover,
    capacity freed by replicas that could not be re-placed can leave room in a
    group that an *unaffected* model does not use; failover does not move
    unaffected replicas (that is a rebalancing job), so the check does not apply.
    """
    problems: list[str] = []
    used: dict[str, list[int]] = {n.name: [0] * len(n.devices) for n in topology.nodes}
    fractions: dict[str, list[float]] = {n.name: [0.0] * len(n.devices) for n in topology.nodes}
    per_node: Counter = Counter()
    ids: Counter = Counter()
    for a in plan.assignments:
        ids[a.replica_id] += 1
        spec = catalogue.get(a.model)
        if spec is None:
            problems.append(f"{a.replica_id}: model {a.model!r} is not in the catalogue")
            continue
        if not a.replica_id.startswith(a.model + "/r"):
            problems.append(f"{a.replica_id}: id does not name its model {a.model}")
        if len(a.stages) != spec.pipeline_parallel:
            problems.append(f"{a.replica_id}: {len(a.stages)} stages, pipeline_parallel is {spec.pipeline_parallel}")
        if len({s.node for s in a.stages}) != len(a.stages):
            problems.append(f"{a.replica_id}: two pipeline stages share a node {a.nodes}")
        if len({topology.node(s.node).fault_group for s in a.stages}) != 1:
            problems.append(f"{a.replica_id}: pipeline stages span fault groups {a.nodes}")
        for s in a.stages:
            node = topology.node(s.node)
            per_node[s.node] += 1
            if s.node in plan.down_nodes:
                problems.append(f"{a.replica_id}: placed on down node {s.node}")
            if len(s.gpus) != spec.tensor_parallel or len(set(s.gpus)) != len(s.gpus):
                problems.append(f"{a.replica_id}: stage on {s.node} has devices {s.gpus}, tensor_parallel is "
                                f"{spec.tensor_parallel}")
            if not any(set(s.gpus) <= set(d) for d in node.nvlink_domains):
                problems.append(f"{a.replica_id}: devices {s.gpus} on {s.node} leave one NVLink domain")
            for d in s.gpus:
                if not 0 <= d < len(node.devices):
                    problems.append(f"{a.replica_id}: {s.node} has no device {d}")
                    continue
                dev = node.devices[d]
                if a.bytes_per_gpu != spec.reservation(dev):
                    problems.append(f"{a.replica_id}: reserves {a.bytes_per_gpu} B on {s.node}/{d}, "
                                    f"model claims {spec.reservation(dev)} B")
                if spec.need_per_device > a.bytes_per_gpu:
                    problems.append(f"{a.replica_id}: needs {spec.need_per_device} B per device, "
                                    f"reservation is {a.bytes_per_gpu} B")
                used[s.node][d] += a.bytes_per_gpu
                fractions[s.node][d] += a.bytes_per_gpu / dev.memory
    problems += [f"replica id {rid} used {n} times" for rid, n in ids.items() if n > 1]
    for node in topology.nodes:
        for d, dev in enumerate(node.devices):
            if used[node.name][d] > dev.memory or fractions[node.name][d] > 1 + FRACTION_SLACK:
                problems.append(f"{node.name}/{d}: over-committed, {used[node.name][d]} B of {dev.memory} B "
                                f"(fraction {fractions[node.name][d]:.4f})")
            if plan.memory_used.get(node.name, [None] * len(node.devices))[d] != used[node.name][d]:
                problems.append(f"{node.name}/{d}: plan says {plan.memory_used.get(node.name)} used, "
                                f"assignments add up to {used[node.name][d]}")
        if per_node[node.name] > max_replicas_per_node:
            problems.append(f"{node.name}: {per_node[node.name]} replicas > max_replicas_per_node "
                            f"{max_replicas_per_node}")
    if spread:
        problems += _spread_violations(plan, topology, catalogue, max_replicas_per_node, used, per_node)
    problems += [f"unplaced {u.model} x{u.count} has no reason" for u in plan.unplaced if not u.reason.strip()]
    return problems


def _spread_violations(plan: Plan, topology: Topology, catalogue: dict[str, ModelSpec], cap: int,
                       used: dict[str, list[int]], per_node: Counter) -> list[str]:
    free = {n.name: [dev.memory - u for dev, u in zip(n.devices, used[n.name])] for n in topology.nodes}
    live_groups = [g.name for g in topology.groups if any(h not in plan.down_nodes for h in g.nodes)]
    counts: dict[str, Counter] = defaultdict(Counter)
    for a in plan.assignments:
        counts[a.model][topology.node(a.node).fault_group] += 1
    problems = []
    for model, per_group in counts.items():
        spec = catalogue.get(model)
        if spec is None:
            continue
        for low in live_groups:
            high = max(live_groups, key=lambda g: per_group[g])
            if per_group[high] > per_group[low] + 1 and _group_can_host(plan, topology, spec, low, cap, free, per_node):
                problems.append(f"{model}: {per_group[high]} replicas in {high} but {per_group[low]} in {low}, "
                                f"which has room for more")
    return problems
