"""Several routers in the simulator: the same workload through 1, 2 and 4 routers, each a real Dispatcher
behind one thread that spends the measured router CPU per request, per token chunk and per replica stats
message (sim/routers.py).

    python benchmarks/bench_router_scaleout_sim.py [--site exa256-a100] [--duration 30] [--routers 1 2 4]
        [--cost-us 47] [--chunk-cost-us C] [--stats-cost-us S] [--coalesce-ms 20] [--coalesce-tokens 16]
        [--pick round_robin|sticky] [--prefix-mode approximate|precise] [--json OUT]

Where two cores cannot run several router threads side by side, this shows what sharing the fleet does at
the seed's scale. Default: exa256-a100 (256 nodes, 3,072 replicas held at the plan, as bench_simulator's
exa256 part) with exa256-mix compressed so its diurnal peak (~21,800 requests/s) falls in the middle of
--duration, no faults; 47 us a request (benchmarks/bench_router_throughput.py, prefix affinity, compiled
index, 3,072 replicas, packed prompts, 2026-12-01): one thread routes at most ~21,400 requests/s, so one
router is saturated at the peak (1.02 CPU-seconds a second) before any chunk or stats. Each chunk a
replica streams beyond the first costs --chunk-cost-us more (the chunks a replica's coalescer sends for the
answer's tokens: router.coalesce_ms / coalesce_tokens at its step time) and each replica's stats, reaching
every router once a second, --stats-cost-us (defaults: sim/routers.py's measured CHUNK_COST_S and
STATS_COST_S, on every site; 0 and 0 give the request-only model). With them (2026-12-01, chunks sent
batched: 2.5 us each) a request costs ~148 us (~40 chunks beyond the first at exa256-a100's step times and
20 ms coalescing) and the stats take 3.8% of each router: together they sustain ~6,500 requests/s a
router, so exa256-mix's peak saturates 1 and 2 routers, 3 hold it at 97% in the busiest interval, 4 at 75%
and 6 at 51%; 64 at 8%, 0 lost (exa256-a100 ships 64, for its gateways: docs/benchmarks.md). One chunk a frame (--chunk-cost-us 7.6, the figure before replicas
and gateways batched them) needed 8 (89%) to 12 (60%). --site small16-a100
runs the same shape in seconds: its peak is scaled to the site (--qps, default 200 requests/s) and the cost
with it (--cost-us default there 7,850 us: 1.57 CPU-seconds a second at the peak, a clearer saturation),
which is what the tests do.

First a reference: one router at no CPU cost (the fleet and the policy alone; --no-reference skips it).
Printed per router count: the requests/s the routers can sustain together (count x the share of a thread
the stats leave / the CPU a request costs with its chunks) and the most they routed in a sample interval,
per router load (CPU-seconds asked per second over the arrivals), utilisation,
queue peak and share, TTFT mean / p99 (the router's queue is part of it), the prefix-cache hit rate
against the reference's (approximate mode: each router knows only its own choices; a saturated router
also changes the hit rate, by holding requests back), lost requests (target 0).
Targets: 0 lost for every count; with more than one router each router's load below 1 (with chunks and
stats charged, 2 routers miss it on exa256 (busiest interval 100%): pass --routers 3 4 6).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exaserve_hpc.config.schema import load_site, parse_site  # noqa: E402
from exaserve_hpc.sim.routers import CHUNK_COST_S, PICKS, ROUTER_COST_S, STATS_COST_S  # noqa: E402
from exaserve_hpc.sim.simulation import Simulation  # noqa: E402
from exaserve_hpc.sim.workload import Workload, load_workload, parse_workload  # noqa: E402

PEAK_LOAD = 1.57  # small16: CPU-seconds a second one router is asked for at the peak (exa256-mix x 72 us: a clear saturation)


def workload(site_name: str, duration: float, qps: float) -> Workload:
    if site_name.startswith("exa256"):
        wl = load_workload("exa256-mix")
        for s in wl.streams:
            s.period = duration  # trough at both ends, the peak in the middle
            s.bursts = []
        wl.faults = []
        return wl
    return parse_workload({"name": f"steady-{qps:g}", "duration": duration, "slo": {"ttft_p99": "2s", "e2e_p99": "30s"},
                           "streams": [{"model": "llama-3.1-8b-instruct", "qps": qps,
                                        "diurnal": {"period": duration, "trough": 0.3},
                                        "input_tokens": {"mean": 400, "sigma": 0.7, "max": 6000},
                                        "output_tokens": {"mean": 80, "sigma": 0.6, "max": 1024},
                                        "prefix_groups": {"count": 200, "system_tokens": 256, "zipf": 1.05}}]})


def run(site, wl: Workload, duration: float, routers: int, cost: float, pick: str, chunk_cost: float = 0.0,
        stats_cost: float = 0.0, compare_all: bool = False) -> dict:
    sim = Simulation(site, wl, duration=duration, static=True, routers=routers, router_cost=cost, router_pick=pick,
                     router_chunk_cost=chunk_cost, router_stats_cost=stats_cost)
    if compare_all:  # prefix affinity compares every replica of the model instead of the holders and a draw of 4
        for thread in sim.router.threads:
            thread.dispatcher.policy.settings.compare_all_up_to = 1 << 30
    t, cpu = time.perf_counter(), time.process_time()
    s = sim.run()
    s.update(wall_s=round(time.perf_counter() - t, 1), cpu_s=round(time.process_time() - cpu, 1))
    return s


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--site", default="exa256-a100")
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds of arrivals")
    p.add_argument("--routers", type=int, nargs="*", default=[1, 2, 4], help="router counts to run (none: the reference only)")
    p.add_argument("--cost-us", type=float, help=f"router CPU per request (default {ROUTER_COST_S * 1e6:g} us on "
                                                 "exa256; scaled to the peak elsewhere)")
    p.add_argument("--chunk-cost-us", type=float, default=CHUNK_COST_S * 1e6,
                   help=f"router CPU per token chunk beyond a request's first (default {CHUNK_COST_S * 1e6:g} us)")
    p.add_argument("--stats-cost-us", type=float, default=STATS_COST_S * 1e6,
                   help=f"router CPU per replica stats message (default {STATS_COST_S * 1e6:g} us)")
    p.add_argument("--qps", type=float, default=200.0, help="peak requests/s on a site other than exa256")
    p.add_argument("--pick", choices=PICKS, default="round_robin")
    p.add_argument("--prefix-mode", choices=["approximate", "precise"], default="approximate")
    p.add_argument("--index-blocks", type=int, help="router.index_blocks (default: the site's): at exa256's rate "
                                                     "one router's approximate index drops a generation every few s")
    p.add_argument("--coalesce-ms", type=float, help="router.coalesce_ms (default: the site's): a replica's chunks "
                                                     "are fewer the longer it holds tokens back")
    p.add_argument("--coalesce-tokens", type=int, help="router.coalesce_tokens (default: the site's)")
    p.add_argument("--no-reference", action="store_true", help="skip the one-router, no-cost reference run")
    p.add_argument("--compare-all", action="store_true",
                   help="also run the reference with prefix affinity comparing every replica (not the holders and a "
                        "draw of 4, as deployed at more than 32 replicas): the draw's mean TTFT against it (target <= 1.1x)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    data = load_site(ROOT / "site-configs" / f"{args.site}.yaml").model_dump(mode="json", exclude_none=True)
    data["router"]["prefix_mode"] = args.prefix_mode
    if args.index_blocks:
        data["router"]["index_blocks"] = args.index_blocks
    for key in ("coalesce_ms", "coalesce_tokens"):
        if getattr(args, key) is not None:
            data["router"][key] = getattr(args, key)
    site = parse_site(data)
    wl = workload(args.site, args.duration, args.qps)
    cost = args.cost_us * 1e-6 if args.cost_us is not None else (
        ROUTER_COST_S if args.site.startswith("exa256") else PEAK_LOAD / args.qps)
    chunk_cost, stats_cost = args.chunk_cost_us * 1e-6, args.stats_cost_us * 1e-6
    print(f"{args.site}, {wl.name} over {args.duration:g} s (peak in the middle), {1e6 * cost:g} us of router CPU "
          f"a request, {args.chunk_cost_us:g} us a further chunk (coalesced at {site.router.coalesce_ms:g} ms / "
          f"{site.router.coalesce_tokens} tokens), {args.stats_cost_us:g} us a stats message, gateways {args.pick}, prefix mode {args.prefix_mode}, index {site.router.index_blocks:,} "
          f"blocks; SLO TTFT p99 {wl.slo_ttft_p99:g} s")
    results, ok = {}, True
    if not args.no_reference:
        ref = results["reference"] = run(site, wl, args.duration, 1, 0.0, args.pick)
        print(f"\nreference, 1 router at no CPU cost: {ref['lost']} lost; TTFT mean {ref['ttft_mean_s']:.3f} s, "
              f"p50 {ref['ttft_p50_s']:.3f} s, p99 {ref['ttft_p99_s']:.3f} s; prefix hit rate {ref['prefix_hit_rate']:.1%}")
        ok &= ref["lost"] == 0
        if args.compare_all:
            every = results["compare_all"] = run(site, wl, args.duration, 1, 0.0, args.pick, compare_all=True)
            ratio = ref["ttft_mean_s"] / every["ttft_mean_s"]
            print(f"compare-all, 1 router at no CPU cost: {every['lost']} lost; TTFT mean {every['ttft_mean_s']:.3f} s, "
                  f"p99 {every['ttft_p99_s']:.3f} s; hit rate {every['prefix_hit_rate']:.1%} ({every['wall_s']} s wall); "
                  f"the deployed draw's mean TTFT is {ratio:.3f}x compare-all's (target <= 1.1)")
            ok &= ratio <= 1.1
    for n in args.routers:
        s = run(site, wl, args.duration, n, cost, args.pick, chunk_cost, stats_cost)
        r = s["routers"]
        results[n] = s
        base = results.get("reference") or results[args.routers[0]]
        print(f"\n{n} router(s): {s['accepted']} accepted, {s['completed']} completed, {s['lost']} lost, "
              f"{s['failed']} failed; peak arrivals {s['peak_qps']:,.0f}/s; {s['wall_s']} s wall, {s['cpu_s']} s CPU")
        print(f"  a request costs {1e6 * r['cpu_per_request_s']:.1f} us of router CPU with its chunks "
              f"({r['chunks_per_request']:g} beyond the first, mean); stats take {r['stats_share']:.1%} of each router")
        print(f"  routers can sustain {r['capacity_per_s']:,.0f} requests/s together; routed at most "
              f"{sum(x['routed_per_s_peak'] for x in r['per_router']):,.0f}/s (sum of each router's busiest interval)")
        for x in r["per_router"]:
            print(f"  router {x['router']}: share {x['share']:.1%}, load {x['load']:.2f} CPU-s/s, utilisation "
                  f"{x['utilisation']:.1%} (busiest interval {x['utilisation_peak']:.1%}), queue peak {x['queue_peak']}, "
                  f"wait mean {1000 * x['wait_mean_s']:.1f} ms, max {x['wait_max_s']:.2f} s; prefix index "
                  f"generations evicted {x['index_generations_evicted']}")
        print(f"  TTFT mean {s['ttft_mean_s']:.3f} s, p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s; "
              f"e2e p99 {s['e2e_p99_s']:.2f} s; prefix hit rate {s['prefix_hit_rate']:.1%} "
              f"({100 * (s['prefix_hit_rate'] - base['prefix_hit_rate']):+.1f} points against "
              f"{'the reference' if 'reference' in results else f'{args.routers[0]} router(s)'})")
        print("  TTFT p50 / p99 per model: " + ", ".join(f"{m} {v['ttft_p50_s']:.2f} / {v['ttft_p99_s']:.2f} s"
                                                       for m, v in s["by_model"].items()))
        ok &= s["lost"] == 0
        if n > 1:
            ok &= all(x["load"] < 1 for x in r["per_router"])
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): s for n, s in results.items()}, indent=1, default=str))
    print("\nall targets met" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
