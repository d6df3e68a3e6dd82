"""`exaserve capacity`: a workload's peak rate and request mix -> replicas per model (scheduler/capacity.py,
30% headroom), then (--check) the simulator runs the workload on the site with exactly those replicas,
fixed, and says whether the answer holds the workload's SLO.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from exaserve_hpc.config.schema import SiteConfig, parse_site
from exaserve_hpc.scheduler.capacity import HEADROOM, RequestMix, replicas_for_mix
from exaserve_hpc.scheduler.catalogue import catalogue_from_site
from exaserve_hpc.sim.workload import Workload, arrivals, workload_from_args

WINDOW = 60.0  # seconds over which the peak rate is taken


def workload_mix(workload: Workload, duration: float, seed: int = 0,
                 max_seq: Optional[dict[str, int]] = None) -> list[RequestMix]:
    """Per model: the highest rate over any WINDOW-second window, and the mean prompt and output lengths,
    over the requests the gateway would accept (prompt + output within the model's max_seq_len)."""
    per: dict[str, list] = {}
    for r in arrivals(workload, duration, seed):
        if max_seq is not None and r.prompt + r.max_tokens > max_seq.get(r.model, 1 << 62):
            continue
        p = per.setdefault(r.model, [0, 0, 0, {}])
        p[0] += 1
        p[1] += r.prompt
        p[2] += r.max_tokens
        w = int(r.arrival // WINDOW)
        p[3][w] = p[3].get(w, 0) + 1
    return [RequestMix(m, max(p[3].values()) / min(WINDOW, duration), p[1] / p[0], p[2] / p[0])
            for m, p in sorted(per.items())]


def sized_site(site: SiteConfig, replicas: dict[str, int], floor: bool = True) -> SiteConfig:
    """The site with each model's replica count (and, with `floor`, its min_replicas) set to `replicas`;
    models not named keep theirs."""
    data = site.model_dump(mode="json", exclude_none=True)
    for m in data["models"]:
        if m["model_name"] in replicas:
            m["replicas"] = replicas[m["model_name"]]
            if floor:
                m["min_replicas"] = replicas[m["model_name"]]
    return parse_site(data)


def plan(site: SiteConfig, workload: Workload, headroom: float = HEADROOM) -> tuple[list[RequestMix], list]:
    specs = catalogue_from_site(site)
    share = {m.model_name: max(1, math.floor(1 / m.gpu_memory_utilization + 1e-9)) for m in site.models}
    mixes = workload_mix(workload, workload.duration, max_seq={m.model_name: m.max_seq_len for m in site.models})
    return mixes, replicas_for_mix(specs, mixes, share, headroom=headroom)


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
        from exaserve_hpc.sim.run import simulate
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
