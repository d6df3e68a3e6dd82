"""`exaserve simulate`: run a workload on a site in simulated time, with a progress bar, and write the report.

With --compare the same workload runs twice, once with replicas fixed at the site's plan (--static alone
runs only that) and once under the running policies, and the report compares GPU utilisation at the
workload's latency SLO.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.sim.routers import CHUNK_COST_S, ROUTER_COST_S, STATS_COST_S
from exaserve_hpc.sim.simulation import Simulation
from exaserve_hpc.sim.workload import Workload


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


