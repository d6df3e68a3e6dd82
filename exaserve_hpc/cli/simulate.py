"""`exaserve simulate` and `exaserve capacity`: their arguments and what they print (the simulation is
sim/run.py, the capacity answer sim/capacity_check.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.controller.capacity import HEADROOM
from exaserve_hpc.sim.capacity_check import plan, sized_site
from exaserve_hpc.sim.report import write_report
from exaserve_hpc.sim.routers import CHUNK_COST_S, PICKS, ROUTER_COST_S, STATS_COST_S
from exaserve_hpc.sim.run import comparison_text, routers_line, simulate
from exaserve_hpc.sim.workload import workload_from_args


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
        if importlib.util.find_spec("matplotlib") is None:  # before a long run, not after it
            console.print("[red]error[/]: --out writes a report with plots, which needs matplotlib; install the "
                          "simulator's extra: pip install 'exaserve-hpc[sim]'", highlight=False)
            return 2
    runs = ["static"] if args.static else ["static", "dynamic"] if args.compare else ["dynamic"]
    sites = {name: site for name in runs}
    if args.size_by_capacity:
        # Each model at what `exaserve capacity` answers for its own peak (30% headroom): the static
        # allocation a centre would book for this workload; the dynamic run starts there and scales.
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


def cmd_capacity(args: argparse.Namespace, site: SiteConfig, console: Console) -> int:
    workload = workload_from_args(args, console)
    if workload is None:
        return 2
    mixes, estimates = plan(site, workload, args.headroom)
    answer = {e.model: e.replicas for e in estimates}
    table = Table(title=f"capacity for {workload.name} on {site.site} ({args.headroom:.0%} headroom)")
    for col in ("model", "peak req/s", "in tokens", "out tokens", "req/s per replica", "replicas", "site has"):
        table.add_column(col, justify="left" if col == "model" else "right")
    have = {m.model_name: site.initial_replicas(m) for m in site.models}
    for mix, est in zip(mixes, estimates):
        table.add_row(mix.model, f"{mix.qps:.1f}", f"{mix.input_tokens:.0f}", f"{mix.output_tokens:.0f}",
                      f"{est.requests_per_s_per_replica:.2f}", str(est.replicas), str(have.get(mix.model, 0)))
    console.print(table)
    result = {"site": site.site, "workload": workload.name, "headroom": args.headroom,
              "models": [{"model": m.model, "peak_qps": m.qps, "input_tokens": m.input_tokens,
                          "output_tokens": m.output_tokens, "replicas": e.replicas,
                          "requests_per_s_per_replica": e.requests_per_s_per_replica, "reason": e.reason}
                         for m, e in zip(mixes, estimates)]}
    code = 0
    if args.check:
        try:
            sized = sized_site(site, answer)
        except Exception as exc:  # the answer does not fit the machine
            console.print(f"[red]the answer does not fit {site.site}[/]: {exc}", highlight=False)
            return 1
        _, summary, wall = simulate(sized, workload, args.duration, static=True, label="capacity check")
        held = summary["slo_held"]
        slo = summary["slo"]
        console.print(f"simulated with those replicas fixed ({wall:.0f} s wall): TTFT p99 {summary['ttft_p99_s']:.3f} s "
                      f"(SLO {slo['ttft_p99_s']:g} s), e2e p99 {summary['e2e_p99_s']:.2f} s (SLO {slo['e2e_p99_s']:g} s), "
                      f"{summary['lost']} lost, GPU utilisation {summary['gpu_util_allocated']:.1%}: the answer "
                      f"{'holds' if held else 'does NOT hold'} the SLO", highlight=False)
        result["check"] = {k: summary[k] for k in ("ttft_p99_s", "e2e_p99_s", "lost", "gpu_util_allocated",
                                                   "slo", "slo_held", "wall_s", "simulated_s")}
        code = 0 if held else 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return code




def add_capacity_arguments(parser: argparse.ArgumentParser, site_help: str) -> None:
    parser.add_argument("--site", help=site_help)
    parser.add_argument("--workload", required=True, help="workload YAML file or shipped name (its peak rate and mix)")
    parser.add_argument("--rate", type=float, help="multiply every stream's request rate by this")
    parser.add_argument("--headroom", type=float, default=HEADROOM, help=f"spare capacity over the peak, a fraction (default {HEADROOM:g})")
    parser.add_argument("--check", action="store_true", help="simulate the answer and say whether it holds the SLO")
    parser.add_argument("--duration", type=float, help="--check: simulated seconds (default: the workload's)")
    parser.add_argument("--json", help="also write the answer (and the check) here")
