"""Scheduler benchmarks at target scale (exa256-a100: 256 nodes x 8 GPUs, 3072 replicas).

Run: .venv/bin/python benchmarks/bench_scheduler.py [--runs N]
Prints median, min and max wall time of each operation against its target: the pure planner's
(plan_site, failover) and, in the same run, the running controller's: 256 in-process agents (no sockets:
their AgentHellos go straight to `Controller.handle`) and the controller placing all 3,072 replicas
(StartReplica messages built, the placement audited), then a node's heartbeats stopping and the tick
that declares it lost and re-places its replicas. Every model's minimum is its replica count, so the
autoscaler holds and the tick times placement, not scale-downs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import yaml  # noqa: E402

from exaserve_hpc.config.schema import load_site, parse_site  # noqa: E402
from exaserve_hpc.protocol import AgentHello, GpuInfo, MemoryPoolStatus, StartReplica  # noqa: E402
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.autoscale import AutoscalePolicy, ModelLoad, ScalingHistory, autoscale  # noqa: E402
from exaserve_hpc.controller.catalogue import catalogue_from_site  # noqa: E402
from exaserve_hpc.controller.core import ControllerCore  # noqa: E402
from exaserve_hpc.controller.failover import failover, failover_fault_group  # noqa: E402
from exaserve_hpc.controller.placement import plan_site  # noqa: E402
from exaserve_hpc.topology import topology_from_site  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



TARGETS_S = {"full plan, 3072 replicas on 256 nodes": 0.5, "replan after one node loss": 0.020,
             "replan after one fault-group loss": 0.100, "autoscaler tick, 50 models": 0.005,
             "controller: 256 hellos, 3072 placed": 2.0, "controller: node loss re-placed": 0.200}


class StubRouter(RouterPortStub):
    """What the controller reads of the router (router/port.py); nothing routed (the benchmark times the
    controller)."""


def held_site():
    """exa256-a100 with every model's minimum at its replica count (the autoscaler holds)."""
    data = yaml.safe_load((ROOT / "site-configs" / "exa256-a100.yaml").read_text())
    for model in data["models"]:
        model["min_replicas"] = model.get("replicas", data["scheduler"].get("min_replicas_per_model", 4))
    return parse_site(data)


def hellos(site) -> list[AgentHello]:
    gpus = [GpuInfo(index=i, name="A100", memory_total=site.cluster.gpu_memory) for i in range(site.cluster.gpus_per_node)]
    pool = MemoryPoolStatus(block_size=1 << 30, total=[site.cluster.gpu_memory] * len(gpus),
                            free=[site.cluster.gpu_memory] * len(gpus))
    return [AgentHello(agent_id=h, hostname=h, pid=1, gpus=gpus, host_memory_total=1 << 40, memory=pool)
            for h in site.cluster.hostnames()]


def starts(outbox) -> int:
    """Replicas started: one StartReplica each, or one per stage of a pipeline-parallel replica (rank 0 counted)."""
    return sum(isinstance(m, StartReplica) and getattr(getattr(m, "stage", None), "rank", 0) == 0 for _, m in outbox)


def controller_run(site, greetings: list[AgentHello], lost: str) -> tuple[float, float, int, str]:
    """(seconds to place all from the hellos, seconds of the tick that re-places `lost`'s replicas,
    replicas started at first, "<re-placed> of <replicas the lost node held>")."""
    logging.getLogger("exaserve").setLevel(logging.CRITICAL)  # a lost node is an error line per replica
    clock = [0.0]
    ctl = ControllerCore(site, StubRouter(), clock=lambda: clock[0],
                     expected_agents=[g.agent_id for g in greetings])
    t = time.perf_counter()
    for hello in greetings:
        ctl.handle(hello.agent_id, hello)
    placed = time.perf_counter() - t
    first = starts(ctl.fleet.take_outbox())
    held = sum(lost in r.assignment.nodes for r in ctl.replicas.values() if r.assignment is not None)
    clock[0] = site.heartbeat.expiry + site.heartbeat.loss_grace + 1.0  # suspected, then lost
    for agent in ctl.agents.values():
        if agent.agent_id != lost:
            agent.last_seen = clock[0]
    t = time.perf_counter()
    ctl.tick(clock[0])
    replaced = time.perf_counter() - t
    after = starts(ctl.fleet.take_outbox())
    return placed, replaced, first, f"{after} of {held}"


def timed(fn, runs: int) -> list[float]:
    out = []
    for k in range(runs):
        t = time.perf_counter()
        fn(k)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    site = load_site(ROOT / "site-configs" / "exa256-a100.yaml")
    topo, cat, cap = topology_from_site(site), catalogue_from_site(site), site.scheduler.max_replicas_per_node
    plan = plan_site(site)
    assert len(plan.assignments) == 3072 and not plan.unplaced
    hosts = [n.name for n in topo.nodes]
    groups = [g.name for g in topo.groups]
    policy = AutoscalePolicy.from_site(site)
    loads = [ModelLoad(f"model{k:02d}", 10 + k, 5.0 * k, 32) for k in range(50)]
    history = ScalingHistory({f"model{k:02d}": {1: 0.0} for k in range(0, 50, 3)})
    results = {
        "full plan, 3072 replicas on 256 nodes": timed(lambda k: plan_site(site), runs),
        "replan after one node loss": timed(lambda k: failover(plan, topo, cat, [hosts[(k * 37) % 256]], cap), runs),
        "replan after one fault-group loss": timed(
            lambda k: failover_fault_group(plan, topo, cat, groups[k % 16], cap), runs),
        "autoscaler tick, 50 models": timed(lambda k: autoscale(loads, policy, history, 60.0 + k), runs),
    }
    held, greetings = held_site(), hellos(site)
    runs_ctl = [controller_run(held, greetings, hosts[(k * 37 + 5) % 256]) for k in range(max(1, runs // 3))]
    assert all(first == 3072 for _, _, first, _ in runs_ctl), [r[2] for r in runs_ctl]
    results["controller: 256 hellos, 3072 placed"] = [r[0] for r in runs_ctl]
    results["controller: node loss re-placed"] = [r[1] for r in runs_ctl]
    failed = 0
    print(f"{'operation':40s} {'median':>10s} {'min':>10s} {'max':>10s} {'target':>10s}")
    for name, samples in results.items():
        med, target = statistics.median(samples), TARGETS_S[name]
        ok = med <= target
        failed += not ok
        print(f"{name:40s} {med * 1e3:8.2f}ms {min(samples) * 1e3:8.2f}ms {max(samples) * 1e3:8.2f}ms "
              f"{target * 1e3:8.1f}ms  {'ok' if ok else 'OVER TARGET'}")
    print(f"({runs} runs each; the controller's {len(runs_ctl)}, re-placed per node loss: "
          f"{', '.join(r[3] for r in runs_ctl)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
