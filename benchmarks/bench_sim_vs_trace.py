"""The simulator against the trace benchmark: the same requests, policies and loads through both.

    python benchmarks/bench_sim_vs_trace.py [--limit 2000] [--loads 0.70 0.85 0.95] [--policies ...]
        [--capacity R] [--replicas 16]

Both run the same simulated replica (sim/fleet.sim_replica) and the real Dispatcher with each policy as the
site builds it; what differs is everything around them. `exaserve simulate` (sim/simulation.Simulation)
runs the controller core, the node agents' cores, placement, replica start-up, stats every
router.replica_heartbeat from every replica at once, and the router's thread at its measured CPU per request,
chunk and stats message; bench_router_trace.py replays the trace into the replicas directly with each
replica reporting at its own phase. The site is small16-a100 reduced to its 8B model on `--replicas` nodes
of one GPU (each replica a GPU of its own, as in the bench), max_seq_len 131,072; the trace the first
`--limit` usable requests of the Mooncake conversation trace, at each load of the bench's measured capacity
(least_tokens' backlog criterion). Each is run once per seed (the bench's seeds draw its replicas' report
phases and registration order and the policies' draws; the simulator's the policies' draws). Printed: mean
and p99 TTFT from each (means over the seeds, with the range), and the simulator's mean over the bench's
(target: within 10% for every policy and load).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from statistics import fmean as mean

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_trace as bench  # noqa: E402  (a sibling script)

from exaserve_hpc.config.schema import parse_site  # noqa: E402
from exaserve_hpc.sim.simulation import Simulation  # noqa: E402
from exaserve_hpc.sim.workload import parse_workload  # noqa: E402

MODEL = "llama-3.1-8b-instruct"


def site_for(replicas: int, policy: str):
    data = yaml.safe_load(bench.SITE.read_text())
    data["models"] = [dict(m, replicas=replicas, min_replicas=replicas, max_seq_len=131072)
                      for m in data["models"] if m["model_name"] == MODEL]
    cluster = data["cluster"]
    cluster.update(nodes=replicas, nodelist=f"gpu[01-{replicas:02d}]", gpus_per_node=1, nvlink_domain_size=1)
    quarter = -(-replicas // 4)
    cluster["fault_groups"] = {f"rack{k:02d}": f"gpu[{k * quarter + 1:02d}-{min(replicas, (k + 1) * quarter):02d}]"
                               for k in range(4) if k * quarter < replicas}
    data["router"] = dict(data.get("router") or {}, policy=policy)
    return parse_site(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--loads", type=float, nargs="+", default=[0.70, 0.85, 0.95])
    p.add_argument("--policies", nargs="+", default=bench.POLICIES)
    p.add_argument("--capacity", type=float, help="requests/s the loads are fractions of (default: measured)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="each run once per seed; means compared")
    p.add_argument("--json")
    args = p.parse_args(argv)
    logging.getLogger("exaserve_hpc").setLevel(logging.ERROR)  # breakers opening under load: counted, not logged
    site = site_for(args.replicas, "least_tokens")
    fleet = bench.Fleet(site, MODEL, site.cluster.gpu_kind, args.replicas)
    rows, skipped = bench.usable(bench.load_trace(bench.TRACE, args.limit), fleet)
    print(f"{len(rows)} requests ({skipped} skipped); {fleet.describe()}", flush=True)
    capacity = args.capacity or bench.measure_capacity(rows, fleet, log=lambda m: None)[0]
    print(f"capacity {capacity:.2f} requests/s (least_tokens' backlog criterion, bench_router_trace)", flush=True)
    t0 = rows[0].arrival
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in rows:  # the same requests, from time 0
            f.write(json.dumps({"timestamp": round((r.arrival - t0) * 1000), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": r.hash_ids}) + "\n")
        path = f.name
    results, worst = [], 0.0
    print(f"{'load':>5} {'policy':<19} {'bench mean':>10} {'sim mean':>9} {'sim/bench':>9} {'bench p99':>9} {'sim p99':>8}")
    for load in args.loads:
        scale = bench.time_scale(rows, capacity, load)
        shifted = [bench.Row(r.arrival - t0, r.input_length, r.output_length, r.hash_ids) for r in rows]
        for name in args.policies:
            bs = [bench.replay(shifted, name, fleet, scale, seed) for seed in args.seeds]
            wl = parse_workload({"name": "trace", "duration": (shifted[-1].arrival + 1e-3) / scale,
                                 "streams": [{"model": MODEL, "kind": "trace", "path": path, "rate": scale,
                                              "block_tokens": bench.BLOCK}]})
            ss = [Simulation(site_for(args.replicas, name), wl, static=True, routers=1, seed=seed).run()
                  for seed in args.seeds]
            b_mean, s_mean = mean(r["ttft_mean"] for r in bs), mean(r["ttft_mean_s"] for r in ss)
            b_p99, s_p99 = mean(r["ttft_p99"] for r in bs), mean(r["ttft_p99_s"] for r in ss)
            ratio = s_mean / b_mean
            worst = max(worst, abs(ratio - 1))
            results.append({"load": load, "policy": name, "bench_ttft_mean": b_mean, "bench_ttft_p99": b_p99,
                            "sim_ttft_mean": s_mean, "sim_ttft_p99": s_p99, "sim_over_bench": ratio,
                            "bench_range": [min(r["ttft_mean"] for r in bs), max(r["ttft_mean"] for r in bs)],
                            "sim_range": [min(r["ttft_mean_s"] for r in ss), max(r["ttft_mean_s"] for r in ss)]})
            print(f"{load:>5.0%} {name:<19} {b_mean:>9.3f}s {s_mean:>8.3f}s {ratio:>9.3f} {b_p99:>8.2f}s {s_p99:>7.2f}s"
                  f"   bench {min(r['ttft_mean'] for r in bs):.2f}-{max(r['ttft_mean'] for r in bs):.2f}s, "
                  f"simulator {min(r['ttft_mean_s'] for r in ss):.2f}-{max(r['ttft_mean_s'] for r in ss):.2f}s over the seeds",
                  flush=True)
    Path(path).unlink()
    print(f"largest difference: {worst:.1%} (target: within 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
