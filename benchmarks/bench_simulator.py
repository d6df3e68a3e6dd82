"""The simulator at the seed's scale: simulated seconds per wall second, and where the wall time goes.

    python benchmarks/bench_simulator.py [--part exa256|small16|both] [--duration S] [--small16 static dynamic] [--json OUT]

exa256: exaserve simulate's core on exa256-a100 (256 nodes x 8 A100, 3,072 replicas placed by the real
controller and held there, as --static: the autoscaler decides nothing, failover re-places) with the exa256-mix workload compressed so its diurnal peak (> 20,000 requests/s) falls in
the middle of --duration (default 150 s), a slow node at 20%, a node lost at 30%, a fault group (16 nodes)
lost at 50%, the controller's node at 80%; the site's routers (or --routers) at --router-cost-us of CPU per
request (one router saturates at this peak with the measured 72 us: see bench_router_scaleout_sim.py). Reported: simulated/wall ratio (target >= 0.2), peak
requests/s, lost requests (target 0), and the share of wall time spent inside the real Dispatcher
(gateway-side on_request and replica messages) and the real Controller (handle and tick): where those
are most of it, the router's per-request cost is the limit, not the simulator.
small16: small16-a100, small16-diurnal (one simulated hour, a diurnal swing, the Mooncake trace beside
a model mix, node/fault-group/slow-node faults), static and dynamic: wall time (target < 600 s each).
`ratio` counts the drain after the last arrival (little happens then); `ratio_arrivals` is the ratio up to
the last arrival, while the full load arrives.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exaserve_hpc.config.schema import load_site  # noqa: E402
from exaserve_hpc.sim.routers import ROUTER_COST_S  # noqa: E402
from exaserve_hpc.sim.simulation import Simulation  # noqa: E402
from exaserve_hpc.sim.workload import Fault, Workload, load_workload  # noqa: E402


class Timer:
    """Wall seconds spent inside wrapped methods."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + clock() - t
        setattr(obj, name, timed)


def exa256_workload(duration: float) -> Workload:
    wl = load_workload("exa256-mix")
    for s in wl.streams:
        s.period = duration  # trough at both ends, the peak in the middle
        s.bursts = [(0.5 * duration, 0.1 * duration, 1.05)]
    wl.faults = [Fault(0.2 * duration, "slow_node", node="gpu100", factor=3.0),
                 Fault(0.3 * duration, "node_loss", node="gpu042"),
                 Fault(0.5 * duration, "fault_group_loss", group="rack07"),
                 Fault(0.8 * duration, "controller_node_loss")]
    return wl


def run(site_name: str, workload: Workload, duration: float, static: bool = False, routers: int = 0,
        router_cost: float = ROUTER_COST_S) -> dict:
    site = load_site(ROOT / "site-configs" / f"{site_name}.yaml")
    sim = Simulation(site, workload, duration=duration, static=static, routers=routers, router_cost=router_cost)
    timer = Timer()
    for thread in sim.router.threads:  # every router's Dispatcher (router.count, or --routers)
        for name in ("on_request", "on_replica_message", "on_kv_events", "tick"):
            timer.wrap(thread.dispatcher, name, f"dispatcher.{name}")
    for name in ("handle", "tick"):
        timer.wrap(sim.ctl, name, f"controller.{name}")
    arrive, last = sim._arrive, [0.0, 0.0, 0.0]

    def arriving(now, *args):  # wall, CPU and simulated time of the last arrival: the ratio while load arrives
        last[0], last[1], last[2] = time.perf_counter(), now, time.process_time()
        return arrive(now, *args)
    sim._arrive = arriving
    t, cpu0 = time.perf_counter(), time.process_time()
    s = sim.run()
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu0
    s.update(arrivals_wall_s=round(last[0] - t, 1),
             ratio_arrivals=round((last[1] - sim.t0) / max(1e-9, last[0] - t), 3),
             ratio_arrivals_cpu=round((last[1] - sim.t0) / max(1e-9, last[2] - cpu0), 3))
    # The machine is shared: CPU seconds of this process say what the simulator costs, wall what it got.
    s.update(wall_s=round(wall, 1), ratio=round(s["simulated_s"] / wall, 3), cpu_s=round(cpu, 1),
             ratio_cpu=round(s["simulated_s"] / cpu, 3),
             inside={k: round(v, 1) for k, v in sorted(timer.seconds.items())},
             dispatcher_share=round(sum(v for k, v in timer.seconds.items() if k.startswith("dispatcher")) / wall, 3),
             controller_share=round(sum(v for k, v in timer.seconds.items() if k.startswith("controller")) / wall, 3),
             us_per_request=round(1e6 * wall / max(1, s["accepted"]), 1))
    return s


def show(name: str, s: dict, target: str) -> None:
    keys = ("simulated_s", "wall_s", "ratio", "arrivals_wall_s", "ratio_arrivals", "ratio_arrivals_cpu", "cpu_s", "ratio_cpu", "accepted", "completed", "lost", "failed", "retries",
            "refused_too_long", "peak_qps", "replicas_placed_max", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "gpu_util_allocated",
            "by_model", "us_per_request", "dispatcher_share", "controller_share", "inside", "nodes_lost", "requeue",
            "prefix_hit_rate", "routers")
    print(f"\n{name} ({target})")
    for k in keys:
        print(f"  {k:22s} {s.get(k)}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["exa256", "small16", "both"], default="both")
    p.add_argument("--duration", type=float, default=150.0, help="exa256: simulated seconds of arrivals")
    p.add_argument("--small16-duration", type=float, default=3600.0)
    p.add_argument("--exa256-dynamic", action="store_true",
                   help="exa256 under the autoscaler (default: the 3,072 planned replicas held, failover on)")
    p.add_argument("--small16", nargs="+", choices=["static", "dynamic"], default=["static", "dynamic"],
                   help="small16: replicas held at the plan (static) and/or under the autoscaler (dynamic)")
    p.add_argument("--routers", type=int, default=0, help="routers sharing the fleet (default: the site's router.count)")
    p.add_argument("--router-cost-us", type=float, default=ROUTER_COST_S * 1e6,
                   help="router CPU per request (sim/routers.py; 0: routing costs no time, as before routers had a cost)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    out, ok = {}, True
    if args.part in ("exa256", "both"):
        s = run("exa256-a100", exa256_workload(args.duration), args.duration, static=not args.exa256_dynamic,
                routers=args.routers, router_cost=args.router_cost_us * 1e-6)
        show("exa256-a100, exa256-mix", s, "ratio >= 0.2, peak >= 20,000 req/s, 3,072 replicas, 0 lost")
        ok &= s["ratio"] >= 0.2 and s["lost"] == 0 and s["peak_qps"] >= 20000 and s["replicas_placed_max"] >= 3072
        out["exa256"] = s
    for mode in (args.small16 if args.part in ("small16", "both") else []):
        s = run("small16-a100", load_workload("small16-diurnal"), args.small16_duration, static=mode == "static",
                routers=args.routers, router_cost=args.router_cost_us * 1e-6)
        show(f"small16-a100, small16-diurnal, one simulated hour, {mode}", s, "wall < 600 s, 0 lost")
        ok &= s["wall_s"] < 600 and s["lost"] == 0
        out[f"small16_{mode}"] = s
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print("\nall targets met" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
