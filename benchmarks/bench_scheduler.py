"""Scheduler benchmarks at target scale (exa256-a100: 256 nodes x 8 GPUs, 3072 replicas).

Run: .venv/bin/python benchmarks/bench_scheduler.py [--runs N]
Prints median, min and max wall time of each operation against its target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exaserve_hpc.config import load_site  # noqa: E402
from exaserve_hpc.scheduler.autoscale import AutoscalePolicy, ModelLoad, ScalingHistory, autoscale  # noqa: E402
from exaserve_hpc.scheduler.catalogue import catalogue_from_site  # noqa: E402
from exaserve_hpc.scheduler.failover import failover, failover_fault_group  # noqa: E402
from exaserve_hpc.scheduler.placement import plan_site  # noqa: E402
from exaserve_hpc.topology import topology_from_site  # noqa: E402

TARGETS_S = {"full plan, 3072 replicas on 256 nodes": 0.5, "replan after one node loss": 0.020,
             "replan after one fault-group loss": 0.100, "autoscaler tick, 50 models": 0.005}


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
    failed = 0
    print(f"{'operation':40s} {'median':>10s} {'min':>10s} {'max':>10s} {'target':>10s}")
    for name, samples in results.items():
        med, target = statistics.median(samples), TARGETS_S[name]
        ok = med <= target
        failed += not ok
        print(f"{name:40s} {med * 1e3:8.2f}ms {min(samples) * 1e3:8.2f}ms {max(samples) * 1e3:8.2f}ms "
              f"{target * 1e3:8.1f}ms  {'ok' if ok else 'OVER TARGET'}")
    print(f"({runs} runs each)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
