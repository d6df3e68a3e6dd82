"""One /metrics scrape of a target-scale fleet: bytes and milliseconds.

    python benchmarks/bench_metrics_scrape.py [--replicas 3072] [--nodes 256] [--gpus 8] [--rounds 15]

A synthetic fleet (every replica serving and routed, every node with NVML readings for each GPU and an
L2 cache) is handed to the real collector (observability/collector.py) on the real registry
(exaserve_hpc.metrics.REGISTRY, with the gateway's counters), and each round times what the gateway's
/metrics does: build the families and render the text format (the gateway runs it off its event loop).
Prints each round, then the median and the spread (min..max), the series count and the body size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exaserve_hpc.observability.collector import render_metrics  # noqa: E402
from exaserve_hpc.observability.collector import FLEET, families  # noqa: E402
from exaserve_hpc.observability.readings import (  # noqa: E402
    CheckpointReading, FleetReadings, GpuReading, ModelReading, NodeReading, ReplicaReading,
)


def synthetic_fleet(replicas: int, nodes: int, gpus: int, models: int = 8) -> FleetReadings:
    per_node = max(1, replicas // nodes)
    names = [f"model-{m}" for m in range(models)]
    reps = tuple(
        ReplicaReading(f"{names[i % models]}/r{i:04d}", names[i % models], f"node{(i // per_node) % nodes:03d}",
                       "serving", restarts=i % 3, routed=True, queue_depth=i % 25, inflight=i % 17, running=i % 32,
                       kv_used=(i % 100) / 100, latency_ewma_ms=40.0 + i % 50, requests_finished=1000 + i,
                       tokens_generated=100_000 + 7 * i, prefix_hit_tokens=500 * i, prefix_query_tokens=900 * i + 1,
                       kv_blocks_cached=i % 400, ttft_ms=(80.0 + i % 40, 400.0 + i % 90),
                       tpot_ms=(20.0 + i % 7, 45.0 + i % 11))
        for i in range(replicas))
    node_readings = tuple(
        NodeReading(f"node{n:03d}", lost=False, heartbeat_age=0.5 + (n % 5) / 10, host_memory_used=(1 << 40) // 3,
                    host_memory_total=1 << 40,
                    gpus=tuple(GpuReading(g, 80 << 30, (60 << 30) + g, 71.0 + g, 55.0 + g, 310.5 + g)
                               for g in range(gpus)),
                    l2_capacity=1 << 40, l2_used=300 << 30, l2_hits=n, l2_fills=2 * n, l2_evictions=n % 3,
                    l3_bytes_read=n << 30, replicas=per_node)
        for n in range(nodes))
    model_readings = tuple(ModelReading(m, replicas // models, replicas // models, 4) for m in names)
    router = {"accepted": 10**7, "completed": 10**7 - 50, "failed": 3, "retries": 40, "breaker_opened": 2,
              "inflight": 2000, "pending": 0, "routing": {"affinity": 6 * 10**6, "least_load": 4 * 10**6}}
    return FleetReadings(reps, node_readings, model_readings, router, checkpoint=CheckpointReading(30.0, 300.0, 0))


def series_count(fleet: FleetReadings) -> int:
    return sum(len(f.samples) for f in families(fleet))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3072)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    fleet = synthetic_fleet(args.replicas, args.nodes, args.gpus)
    FLEET.watch_readings(lambda: fleet)
    try:
        render_metrics()  # warm-up
        times, sizes = [], []
        for k in range(args.rounds):
            t0 = time.perf_counter()
            body, _ = render_metrics()
            elapsed = time.perf_counter() - t0
            times.append(elapsed * 1000)
            sizes.append(len(body))
            print(f"round {k + 1}: {elapsed * 1000:.1f} ms, {len(body):,} bytes")
        compressed = len(render_metrics(gzipped=True)[0])  # as the gateway serves Prometheus
    finally:
        FLEET.watch_readings(None)
    print(f"fleet: {args.replicas} replicas on {args.nodes} nodes x {args.gpus} GPUs; "
          f"{series_count(fleet):,} fleet series")
    print(f"scrape: median {statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f}, "
          f"{args.rounds} rounds); body {statistics.median(sizes):,.0f} bytes ({compressed:,} gzipped, as served)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
