"""`exaserve simulate`: run a workload on a site in simulated time, with a progress bar, and write the report.

With --compare the same workload runs twice, once with replicas fixed at the site's plan (--static alone
runs only that) and once under the running policies, and the report compares GPU utilisation at the
workload's latency SLO.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.sim.report import write_report
from exaserve_hpc.sim.routers import CHUNK_COST_S, PICKS, ROUTER_COST_S, STATS_COST_S
from exaserve_hpc.sim.simulation import Simulation
from exaserve_hpc.sim.workload import Workload, workload_from_args


def simulate(site: SiteConfig, workload: Workload, duration: Optional[float] = None, static: bool = False,
             seed: int = 0, console: Optional[Console] = None, run_dir: Optional[Path] = None,
             label: str = "", routers: int = 0, router_cost: float = ROUTER_COST_S,
             router_pick: str = "round_robin", router_chunk_cost: float = CHUNK_COST_S,
             router_stats_cost: float = STATS_COST_S) -> tuple[Simulation, dict, float]:
    """One run; returns (simulation, summary, wall seconds). routers: 0 is the site's router.count."""
    total = duration or workload.duration
    sim = Simulation(site, workload, duration, seed=seed, static=static, run_dir=run_dir, routers=routers,
                     router_cost=router_cost, router_pick=router_pick, router_chunk_cost=router_chunk_cost,
                     router_stats_cost=router_stats_cost)
    progress = Progress(TextColumn(f"simulating {label or ('static' if static else 'dynamic')}"), BarColumn(),
                        TextColumn("{task.fields[where]}"), TimeElapsedColumn(),
                        console=console or Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("sim", total=total, where="")

        def report(now: float) -> None:
            done = max(0.0, now - getattr(sim, "t0", 0.0))
            progress.update(task, completed=min(done, total),
                            where=f"{done:.0f}/{total:.0f} s simulated, {sim.rec.arrivals} requests, "
                                  f"{len(sim.requests)} in flight")
        sim.on_progress = report
        started = time.perf_counter()
        summary = sim.run()
    wall = time.perf_counter() - started
    summary["wall_s"] = round(wall, 2)
    summary["sim_wall_ratio"] = round(summary["simulated_s"] / max(wall, 1e-9), 3)
    return sim, summary, wall


def per_gpu_hour(summary: dict) -> float:
    return summary["completed"] / max(1e-9, summary["gpu_seconds_allocated"] / 3600)


def comparison_text(static: dict, dynamic: dict) -> dict:
    """Utilisation of the GPUs each run held, at the workload's SLO (both must hold it to compare)."""
    gain = 100 * (dynamic["gpu_util_allocated"] - static["gpu_util_allocated"])
    slo = static["slo"]
    both = static["slo_held"] and dynamic["slo_held"]
    text = (f"SLO: p99 TTFT <= {slo['ttft_p99_s']:g} s and p99 end-to-end <= {slo['e2e_p99_s']:g} s (lost requests: "
            f"static {static['lost']}, dynamic {dynamic['lost']}). "
            f"GPU utilisation (GPU work / GPU-seconds of the GPUs holding a replica): static "
            f"{static['gpu_util_allocated']:.1%}, dynamic {dynamic['gpu_util_allocated']:.1%} "
            f"({gain:+.1f} points); weighted by batch occupancy (sequences / max_batch_size) static "
            f"{static['gpu_batch_occupancy']:.1%}, dynamic {dynamic['gpu_batch_occupancy']:.1%} "
            f"({100 * (dynamic['gpu_batch_occupancy'] - static['gpu_batch_occupancy']):+.1f} points); "
            f"GPU-hours held {static['gpu_seconds_allocated'] / 3600:.1f} vs "
            f"{dynamic['gpu_seconds_allocated'] / 3600:.1f}; requests completed per GPU-hour held "
            f"{per_gpu_hour(static):.0f} vs {per_gpu_hour(dynamic):.0f}. Busy time counts a step of a small batch "
            f"as fully as one of a full batch, so requests per GPU-hour is the efficiency figure. ")
    if not both:
        text += ("Not a like-for-like comparison: " + " and ".join(
            f"the {n} run did not hold the SLO" for n, s in (("static", static), ("dynamic", dynamic))
            if not s["slo_held"]) + ".")
    else:
        occupancy = 100 * (dynamic["gpu_batch_occupancy"] - static["gpu_batch_occupancy"])
        verdict = {(True, True): "holds on both measures", (False, False): "holds on neither measure",
                   (True, False): "holds on busy time only", (False, True): "holds batch-weighted only"}
        text += f"Both held the SLO; the +20-point claim {verdict[gain >= 20, occupancy >= 20]} on this workload."
    return {"static": static, "dynamic": dynamic, "gain_points": round(gain, 1),
            "occupancy_gain_points": round(100 * (dynamic["gpu_batch_occupancy"] - static["gpu_batch_occupancy"]), 1),
            "slo_held_both": both, "text": text}


def routers_line(r: dict) -> str:
    per = "; ".join(f"router {p['router']}: {p['share']:.0%} of requests, load {p['load']:.2f} CPU-s/s, "
                    f"utilisation {p['utilisation']:.0%} "
                    f"(peak {p['utilisation_peak']:.0%}), queue peak {p['queue_peak']}, wait mean "
                    f"{1000 * p['wait_mean_s']:.1f} ms" for p in r["per_router"])
    return (f"routers: {r['count']} at {1e6 * r['cost_per_request_s']:.0f} us a request, "
            f"{1e6 * r['chunk_cost_s']:g} us a further chunk ({r['chunks_per_request']:g} a request), "
            f"{1e6 * r['stats_cost_s']:g} us a stats message ({r['stats_share']:.1%} of each thread) "
            f"(at most {r['capacity_per_s'] or float('inf'):,.0f} requests/s together), gateways {r['pick']}; {per}")


def cmd_simulate(args: argparse.Namespace, site: SiteConfig, console: Console) -> int:
    workload = workload_from_args(args, console)
    if workload is None:
        return 2
    costs = (args.router_cost_us, args.router_chunk_cost_us, args.router_stats_cost_us)
    if (args.routers is not None and not 1 <= args.routers <= 64) or not all(c >= 0 for c in costs):
        console.print(f"[red]error[/]: --routers must be 1..64 (as router.count) and --router-cost-us, "
                      f"--router-chunk-cost-us, --router-stats-cost-us >= 0; got {args.routers} and "
                      f"{', '.join(f'{c:g}' for c in costs)}", highlight=False)
        return 2
    if args.out:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:  # before a long run, not after it
            console.print("[red]error[/]: --out writes a report with plots, which needs matplotlib; install the "
                          "simulator's extra: pip install 'exaserve-hpc[sim]'", highlight=False)
            return 2
    runs = ["static"] if args.static else ["static", "dynamic"] if args.compare else ["dynamic"]
    sites = {name: site for name in runs}
    if args.size_by_capacity:
        # Each model at what `exaserve capacity` answers for its own peak (30% headroom): the static
        # allocation a centre would book for this workload; the dynamic run starts there and scales.
        from exaserve_hpc.sim.capacity_check import plan, sized_site
        answer = {e.model: e.replicas for e in plan(site, workload)[1]}
        console.print("sized by capacity: " + ", ".join(f"{m} {n}" for m, n in sorted(answer.items())),
                      highlight=False)
        sites = {name: sized_site(site, answer, floor=name == "static") for name in runs}
    results = {}
    for name in runs:
        sim, summary, wall = simulate(sites[name], workload, args.duration, static=name == "static", seed=args.seed,
                                      label=name, run_dir=Path(args.out) / "run" if args.out else None,
                                      routers=args.routers or 0, router_cost=args.router_cost_us * 1e-6,
                                      router_pick=args.router_pick,
                                      router_chunk_cost=args.router_chunk_cost_us * 1e-6,
                                      router_stats_cost=args.router_stats_cost_us * 1e-6)
        results[name] = (sim, summary, wall)
        console.print(f"{name}: {summary['simulated_s']:.0f} s simulated in {wall:.1f} s wall "
                      f"(ratio {summary['sim_wall_ratio']:.2f}); {summary['accepted']} accepted, "
                      f"{summary['completed']} completed, {summary['lost']} lost; TTFT p50/p99 "
                      f"{summary['ttft_p50_s']:.3f}/{summary['ttft_p99_s']:.3f} s, e2e p50/p99 "
                      f"{summary['e2e_p50_s']:.2f}/{summary['e2e_p99_s']:.2f} s; GPU utilisation "
                      f"{summary['gpu_util_allocated']:.1%} (batch-weighted {summary['gpu_batch_occupancy']:.1%}); "
                      f"SLO {'held' if summary['slo_held'] else 'NOT held'}",
                      highlight=False)
        console.print(routers_line(summary["routers"]), highlight=False)
    comparison = comparison_text(results["static"][1], results["dynamic"][1]) if len(runs) == 2 else None
    if comparison:
        console.print(comparison["text"], highlight=False)
    if args.out:
        main = results[runs[-1]]
        static = results["static"] if len(runs) == 2 else None
        files = write_report(Path(args.out), main[1], main[0].rec.samples, main[0].rec.events, main[0].t0, main[2],
                             comparison, (static[1], static[0].rec.samples) if static else None)
        console.print(f"report: {files[0]} ({len(files)} files)", highlight=False)
    return 0 if all(r[1]["lost"] == 0 for r in results.values()) else 1


def add_simulate_arguments(parser: argparse.ArgumentParser, site_help: str) -> None:
    parser.add_argument("--site", help=site_help)
    parser.add_argument("--workload", required=True,
                        help="workload YAML file, or a shipped one by name (exaserve_hpc/sim/workloads/)")
    parser.add_argument("--duration", type=float, help="simulated seconds of arrivals (default: the workload's)")
    parser.add_argument("--rate", type=float, help="multiply every stream's request rate by this")
    parser.add_argument("--out", help="write report.md, report.json and plots into this directory")
    parser.add_argument("--static", action="store_true", help="replicas fixed at the site's plan (no autoscaling)")
    parser.add_argument("--compare", action="store_true", help="run static, then dynamic, and compare utilisation")
    parser.add_argument("--size-by-capacity", action="store_true",
                        help="start each model at `exaserve capacity`'s answer for the workload (static: held there)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", type=int, help="routers sharing the fleet (default: the site's router.count)")
    parser.add_argument("--router-cost-us", type=float, default=ROUTER_COST_S * 1e6,
                        help="router CPU per request in microseconds (one thread per router; default "
                             f"{ROUTER_COST_S * 1e6:g}, measured by benchmarks/bench_router_throughput.py; 0: free)")
    parser.add_argument("--router-chunk-cost-us", type=float, default=CHUNK_COST_S * 1e6,
                        help="router CPU per token chunk beyond a request's first, in microseconds, charged for the "
                             "chunks a replica streams under router.coalesce_ms / coalesce_tokens (default "
                             f"{CHUNK_COST_S * 1e6:g}: benchmarks/bench_router_throughput.py --compare-chunks 1 8)")
    parser.add_argument("--router-stats-cost-us", type=float, default=STATS_COST_S * 1e6,
                        help="router CPU per ReplicaStats message, every replica's reaching every router each "
                             f"router.replica_heartbeat (default {STATS_COST_S * 1e6:g}: "
                             "benchmarks/bench_router_throughput.py --compare-stats 8)")
    parser.add_argument("--router-pick", choices=PICKS, default="round_robin",
                        help="how requests spread over the routers' gateways: round_robin (a load balancer) or "
                             "sticky (a prefix's requests keep to one gateway)")
