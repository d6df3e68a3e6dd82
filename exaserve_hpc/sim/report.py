"""A simulation's report: report.md with matplotlib plots (PNG) beside it, and report.json with the figures.

Plots: TTFT and end-to-end latency percentiles over time, GPU utilisation, replicas per model, queue depth
and requests in flight, prefix-cache hit rate, and requests per interval with the failures marked.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

PLOTS = ("latency", "utilisation", "replicas", "queue", "prefix", "failures")


def _plots(samples, events, out: Path, t0: float, tag: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [(s.t - t0) / 60 for s in samples]
    written = []

    def save(fig, name: str) -> None:
        for at, _ in events:
            for ax in fig.axes:
                ax.axvline((at - t0) / 60, color="red", alpha=0.3, lw=1)
        for ax in fig.axes:
            ax.set_xlabel("simulated minutes")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{tag}{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path.name)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    a.plot(t, [s.ttft_p50 for s in samples], label="p50")
    a.plot(t, [s.ttft_p99 for s in samples], label="p99")
    a.set_ylabel("time to first token (s)")
    a.set_yscale("log")
    a.legend()
    b.plot(t, [s.e2e_p50 for s in samples], label="p50")
    b.plot(t, [s.e2e_p99 for s in samples], label="p99")
    b.set_ylabel("end-to-end latency (s)")
    b.set_yscale("log")
    b.legend()
    save(fig, "latency")

    fig, a = plt.subplots(figsize=(8, 3.4))
    a.plot(t, [100 * s.gpu_util_allocated for s in samples], label="of GPUs holding replicas")
    a.plot(t, [100 * s.gpu_util_all for s in samples], label="of all GPUs")
    a.set_ylabel("GPU utilisation (%)")
    a2 = a.twinx()
    a2.plot(t, [s.gpus_allocated for s in samples], color="grey", ls=":", label="GPUs holding replicas")
    a2.set_ylabel("GPUs holding replicas")
    a.legend(loc="upper left")
    save(fig, "utilisation")

    fig, a = plt.subplots(figsize=(8, 3.4))
    for model in samples[0].replicas if samples else ():
        a.plot(t, [s.replicas.get(model, 0) for s in samples], label=model)
    a.set_ylabel("serving replicas")
    a.legend(fontsize=7)
    save(fig, "replicas")

    fig, a = plt.subplots(figsize=(8, 3.4))
    a.plot(t, [s.queue_depth for s in samples], label="waiting (router + replicas)")
    a.plot(t, [s.inflight for s in samples], label="in flight")
    a.set_ylabel("requests")
    a.legend()
    save(fig, "queue")

    fig, a = plt.subplots(figsize=(8, 3.4))
    a.plot(t, [100 * s.prefix_hit_rate for s in samples])
    a.set_ylabel("prefix-cache hit rate (% prompt tokens)")
    save(fig, "prefix")

    fig, a = plt.subplots(figsize=(8, 3.4))
    prev = [samples[0]] + samples[:-1] if samples else []
    dt = samples[1].t - samples[0].t if len(samples) > 1 else 1.0
    a.plot(t, [(s.arrivals - p.arrivals) / dt for s, p in zip(samples, prev)], label="arrivals/s")
    a.plot(t, [(s.completed - p.completed) / dt for s, p in zip(samples, prev)], label="completed/s")
    a.plot(t, [(s.failed - p.failed) / dt for s, p in zip(samples, prev)], label="failed/s", color="red")
    a2 = a.twinx()
    a2.plot(t, [s.nodes_live for s in samples], color="black", ls=":", label="live nodes")
    a2.set_ylabel("live nodes")
    a.set_ylabel("requests/s")
    a.legend(loc="upper left")
    save(fig, "failures")
    return written


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def write_report(out: Path, summary: dict, samples, events, t0: float, wall_s: float,
                 comparison: Optional[dict] = None, static: Optional[tuple] = None) -> list[Path]:
    """Write report.md, report.json and the plots into `out`; `static` is (summary, samples) of the static
    run when one was made (its plots are prefixed static-)."""
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(samples, events, out, t0, "")
    if static is not None:
        images += _plots(static[1], static[0]["events"], out, t0, "static-")
    slo = summary["slo"]
    lines = [f"# Simulation: {summary['workload']} on {summary['site']}", "",
             f"{summary['simulated_s']:.0f} simulated seconds in {wall_s:.1f} s wall "
             f"(ratio {summary['simulated_s'] / max(wall_s, 1e-9):.2f}); arrivals for {summary['duration_s']:.0f} s, "
             "then the run went on until every accepted request had ended.", "",
             "| figure | value |", "|---|---|"]
    rows = [("requests accepted", summary["accepted"]), ("completed", summary["completed"]),
            ("failed (an error to the client)", f"{summary['failed']} {summary['errors'] or ''}"),
            ("lost (accepted, not completed)", summary["lost"]), ("retries on another replica", summary["retries"]),
            ("peak arrivals/s (per sample interval)", f"{summary['peak_qps']:.0f}"),
            ("serving replicas, most at once", summary["replicas_placed_max"]),
            ("TTFT p50 / p99 (s)", f"{_fmt(summary['ttft_p50_s'])} / {_fmt(summary['ttft_p99_s'])}"),
            ("end-to-end p50 / p99 (s)", f"{_fmt(summary['e2e_p50_s'])} / {_fmt(summary['e2e_p99_s'])}"),
            ("SLO (p99 TTFT, p99 end-to-end)", f"{slo['ttft_p99_s']:g} s, {slo['e2e_p99_s']:g} s: "
                                                f"{'held' if summary['slo_held'] else 'NOT held'}"),
            ("GPU utilisation (work / GPU-seconds of GPUs holding replicas)", f"{summary['gpu_util_allocated']:.1%}"),
            ("the same, each step weighted by its batch's fullness", f"{summary['gpu_batch_occupancy']:.1%}"),
            ("nodes lost", ", ".join(summary["nodes_lost"]) or "none"),
            ("requeue decision", summary["requeue"]["why"] if summary["requeue"] else "none")]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "| model | completed | TTFT p50 / p99 (s) | end-to-end p50 / p99 (s) |", "|---|---|---|---|"]
    lines += [f"| {m} | {f['completed']} | {_fmt(f['ttft_p50_s'])} / {_fmt(f['ttft_p99_s'])} | "
              f"{_fmt(f['e2e_p50_s'])} / {_fmt(f['e2e_p99_s'])} |" for m, f in summary.get("by_model", {}).items()]
    routers = summary.get("routers")
    if routers:
        cost = routers["cost_per_request_s"]
        chunks = (f", {1e6 * routers['chunk_cost_s']:.1f} us a further chunk ({routers['chunks_per_request']:.1f} "
                  f"chunks a request), {1e6 * routers['stats_cost_s']:.1f} us a stats message: "
                  f"{1e6 * routers['cpu_per_request_s']:.0f} us a request in all"
                  if routers.get("chunk_cost_s") or routers.get("stats_cost_s") else "")
        lines += ["", f"## Routers: {routers['count']}, {1e6 * cost:.0f} us of CPU a request{chunks}, gateways "
                      f"{routers['pick']}", "",
                  "| router | requests routed | share | load (CPU-s/s) | utilisation (peak interval) | queue peak "
                  "| wait mean / max |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {p['router']} | {p['routed']} | {p['share']:.1%} | {p['load']:.2f} | {p['utilisation']:.1%} "
                  f"({p['utilisation_peak']:.1%}) | {p['queue_peak']} | {1000 * p['wait_mean_s']:.2f} / "
                  f"{1000 * p['wait_max_s']:.1f} ms |" for p in routers["per_router"]]
        lines += ["", f"Prefix-cache hit rate over the run: {summary.get('prefix_hit_rate', 0):.1%} of prompt tokens."]
    if comparison:
        lines += ["", "## Static vs dynamic", "", comparison["text"], "",
                  "| run | GPU utilisation | batch-weighted | GPU-hours held | TTFT p50 / p99 | e2e p99 | SLO held "
                  "| lost |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in ("static", "dynamic"):
            c = comparison[name]
            lines.append(f"| {name} | {c['gpu_util_allocated']:.1%} | {c['gpu_batch_occupancy']:.1%} | "
                         f"{c['gpu_seconds_allocated'] / 3600:.1f} | "
                         f"{_fmt(c['ttft_p50_s'])} / {_fmt(c['ttft_p99_s'])} s | "
                         f"{_fmt(c['e2e_p99_s'])} s | {c['slo_held']} | {c['lost']} |")
    lines += ["", "## Failures and recovery", ""] + [f"- {at - t0:.0f} s: {text}" for at, text in events] + [""]
    for name in images:
        lines += [f"![{name}]({name})", ""]
    (out / "report.md").write_text("\n".join(lines))
    data = {"summary": summary, "wall_s": wall_s, "samples": [asdict(s) for s in samples],
            "comparison": comparison}
    if static is not None:
        data["static"] = {"summary": static[0], "samples": [asdict(s) for s in static[1]]}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    return [out / "report.md", out / "report.json"] + [out / n for n in images]
