"""`exaserve plan --site FILE [--json OUT] [--capacity]`: the initial placement as tables, or as JSON.

Tables (rich): replicas per model (wanted, placed, unplaced), spread per
fault group, device memory use, and what could not be placed and why; with
--capacity, how many more replicas of each model fit beside the plan (each
model alone, placed as the placer would: capacity.placeable_replicas, the
bound the running controller cuts the autoscaler's target to).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exaserve_hpc.config.schema import ConfigError, load_site, resolve_site
from exaserve_hpc.units import format_size
from exaserve_hpc.topology import topology_from_site
from exaserve_hpc.controller.capacity import placeable_replicas
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.placement import plan_site
from exaserve_hpc.controller.plan import Plan

SPREAD_ROWS = 64  # more fault groups than this: a min/max summary per model instead of one row each


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", default=None,
                        help="site name (looked up in site-configs/) or path to a site YAML; default $EXASERVE_SITE or local")
    parser.add_argument("--json", dest="json", metavar="OUT", default=None,
                        help="also write the full plan as JSON to OUT ('-' for stdout)")
    parser.add_argument("--capacity", action="store_true",
                        help="also print how many more replicas of each model fit beside the plan")


def _room_table(site, plan: Plan, limit: int = 100_000) -> Table:
    """Per model: replicas that still fit beside `plan` (the model alone), and why no more."""
    table = Table(title="room beside the plan (each model alone)")
    for col in ("model", "more replicas", "limited by"):
        table.add_column(col, justify="right" if col == "more replicas" else "left")
    topology, cap = topology_from_site(site), site.scheduler.max_replicas_per_node
    for name, spec in catalogue_from_site(site).items():
        room, why = placeable_replicas(plan, topology, spec, cap, limit)
        table.add_row(name, str(room), why or f"stopped counting at {limit}")
    return table


def _models_table(plan: Plan, wanted: dict[str, int]) -> Table:
    table = Table(title=f"replicas per model ({plan.site})")
    for col in ("model", "wanted", "placed", "unplaced"):
        table.add_column(col, justify="left" if col == "model" else "right")
    placed = plan.replicas_per_model()
    for model, want in wanted.items():
        missing = plan.unplaced_count(model)
        table.add_row(model, str(want), str(placed.get(model, 0)), f"[red]{missing}[/]" if missing else "0")
    table.add_row("[b]total[/]", str(sum(wanted.values())), str(len(plan.assignments)), str(plan.unplaced_count()))
    return table


def _spread_table(plan: Plan) -> Table:
    """One row per fault group, one column per model; many groups: a min/max summary per model."""
    groups = list(dict.fromkeys(plan.fault_group_of.values()))
    spread = plan.spread()
    models = list(spread)
    table = Table(title="spread per fault group")
    if len(groups) <= SPREAD_ROWS:
        table.add_column("fault group")
        for m in models:
            table.add_column(m, justify="right")
        for g in groups:
            down = all(n in plan.down_nodes for n, fg in plan.fault_group_of.items() if fg == g)
            table.add_row(g + (" (down)" if down else ""), *(str(spread[m].get(g, 0)) for m in models))
        return table
    for col in ("model", "groups used", "min", "max"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m in models:
        per = [spread[m].get(g, 0) for g in groups]
        table.add_row(m, f"{sum(1 for c in per if c)}/{len(groups)}", str(min(per)), str(max(per)))
    return table


def _memory_table(plan: Plan) -> Table:
    fractions = [u / t for node in plan.memory_total for u, t in zip(plan.memory_used[node], plan.memory_total[node]) if t]
    used = sum(sum(v) for v in plan.memory_used.values())
    total = sum(sum(v) for v in plan.memory_total.values())
    buckets = Counter()
    for f in fractions:
        buckets["idle (0%)" if f == 0 else "up to 50%" if f <= 0.5 else "up to 90%" if f <= 0.9 else "over 90%"] += 1
    table = Table(title="device memory use")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("devices", str(len(fractions)))
    table.add_row("reserved", f"{format_size(used)} of {format_size(total)}")
    if fractions:
        table.add_row("mean per device", f"{sum(fractions) / len(fractions):.1%}")
        table.add_row("fullest device", f"{max(fractions):.1%}")
    for b in ("idle (0%)", "up to 50%", "up to 90%", "over 90%"):
        table.add_row(f"devices {b}", str(buckets[b]))
    return table


def _unplaced_table(plan: Plan) -> Table:
    table = Table(title="could not be placed")
    table.add_column("model")
    table.add_column("count", justify="right")
    table.add_column("reason", overflow="fold")
    for u in plan.unplaced:
        table.add_row(u.model, str(u.count), u.reason)
    return table


def print_plan(plan: Plan, wanted: dict[str, int], console: Console) -> None:
    console.print(_models_table(plan, wanted))
    console.print(_spread_table(plan))
    console.print(_memory_table(plan))
    if plan.unplaced:
        console.print(_unplaced_table(plan))
    else:
        console.print("every replica placed")


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan the site and print it; 2 on a config error, 1 when some replicas could not be placed."""
    try:
        site = load_site(resolve_site(getattr(args, "site", None)))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    plan = plan_site(site)
    wanted = {name: spec.replicas for name, spec in catalogue_from_site(site).items()}
    out = getattr(args, "json", None)
    if out == "-":
        sys.stdout.write(plan.to_json(indent=1) + "\n")
    else:
        console = Console(soft_wrap=False)
        print_plan(plan, wanted, console)
        if getattr(args, "capacity", False):
            console.print(_room_table(site, plan))
        if out:
            Path(out).write_text(plan.to_json(indent=1) + "\n")
            print(f"plan written to {out}")
    return 1 if plan.unplaced else 0
