"""Replay a request trace against simulated replicas, as a site deploys them, under several routing policies.

    python benchmarks/bench_router_trace.py [--site FILE] [--model NAME] [--gpu KIND] [--replicas 16]
        [--loads 0.70 0.85 0.95] [--seeds 0 1 2] [--limit N] [--trace FILE] [--policies ...] [--capacity R]

What is deployed, and only that:
- the replicas are the simulator's (`sim/fleet.sim_replica`, `sim/replica.SimReplica`): the site's model
  (its architecture's roofline on the GPU, engine/gpu_specs.replica_roofline), its max batch size, the
  site's prefill chunk and the deployed engine's step budget (chunk + max batch: TensorRT-LLM's
  max_num_tokens as engine/trtllm_backend sets it; decodes first), KV in what gpu_memory_utilization leaves
  beside the weights, reserved per request as TensorRT-LLM's default capacity scheduler does, prompts
  cached when their prefill ends. `exaserve simulate` runs the same replicas;
- the router is the real `Dispatcher` with each policy as the site builds it (`from_site` on the site's
  router and batching sections: no setting derived from the trace), one router, as on one gateway;
- the replicas report what real ones report (agent/replica_main.py): queue depth, running, KV use and the
  EWMA of their step time, every router.replica_heartbeat (1 s), each at its own phase; the seed draws the
  phases, the order the replicas register in (a policy that breaks ties by candidate order, or takes
  turns, depends on it) and the policies' random draws;
- requests reach the router as gateways send them: with their prompt's block hashes in the policy's scheme
  (`sim/routers.simulated_request`, as the simulator's gateways).
Prompts: the trace gives 512-token block hash ids (two requests that share a hash id share those tokens);
requests longer than the model's max_seq_len or a replica's KV pool are skipped and counted.

Load: the fleet's capacity is measured first, on the same requests (`measure_capacity`: the highest arrival
rate, the trace's times scaled, at which token-aware least-load keeps up: its backlog of requests before
their first token does not grow while they arrive; ``--capacity R`` gives it instead). Each load level
replays the trace scaled to that fraction of it, once per seed. The router's housekeeping runs once a
second as in a router process (`Dispatcher.tick`): a request with no first token within
router.first_token_timeout (60 s) is moved to another replica and that replica's breaker opens, as
deployed. Reported per policy, the mean over seeds with the range: block hit rate, mean and p99 TTFT,
utilisation, replica queues, requests moved by the router and failed; the lower bound no router
can beat (`ttft_bound`); the field's routers beside ours (router/sglang_cache_aware.py,
router/llmd_scheduler.py, router/dynamo_kv.py: their upstream sources are cited there).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from exaserve_hpc.app.routing import dispatch_settings
from exaserve_hpc.config.schema import SiteConfig, load_site
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.engine.gpu_specs import GPU_SPECS
from exaserve_hpc.engine.timing import timings_for
from exaserve_hpc.protocol import Abort, GenerateRequest, ReplicaHello, ReplicaStats, RequestError, TokenChunk
from exaserve_hpc.router.dispatch import REPLICA, Dispatcher
from exaserve_hpc.router.dispatch_state import request_id_of
from exaserve_hpc.router.policies import policy_class
from exaserve_hpc.sim.fleet import scaled_timings, sim_replica
from exaserve_hpc.sim.replica import SharedGpus, SimSeq
from exaserve_hpc.sim.routers import kv_events_of, simulated_request

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SITE = ROOT / "site-configs" / "small16-a100.yaml"
BLOCK = 512  # the trace's hash ids are 512-token blocks
POLICIES = ["round_robin", "least_load", "least_tokens", "sglang_cache_aware", "llmd_scheduler", "dynamo_kv",
            "prefix_affinity"]
FIELD = ("sglang_cache_aware", "llmd_scheduler", "dynamo_kv")


@dataclass
class Row:
    arrival: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: Path, limit: int | None) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.append(Row(r["timestamp"] / 1000.0, r["input_length"], r["output_length"], r["hash_ids"]))
            if limit and len(rows) >= limit:
                break
    return rows


@dataclass
class Fleet:
    """What every replay of one benchmark shares: the site, the model's spec, its replicas' timings and memory."""
    site: SiteConfig
    model: str
    gpu: str
    replicas: int
    max_seq_len: int | None = None  # None: the site's for the model

    def __post_init__(self) -> None:
        self.spec = catalogue_from_site(self.site)[self.model]
        if self.max_seq_len:
            self.spec = replace(self.spec, max_seq_len=self.max_seq_len)
        self.timings = scaled_timings(timings_for(self.gpu), self.spec, GPU_SPECS.get(self.gpu))
        cluster = self.site.cluster  # the site's GPU memory on its own GPU kind, else the datasheet's
        memory = cluster.gpu_memory if cluster.gpu_memory and self.gpu == cluster.gpu_kind else \
            GPU_SPECS[self.gpu].memory_gb * 1e9
        self.memory_bytes = int(self.spec.gpu_memory_utilization * memory)  # what placement reserves a replica
        probe = self.replica(0, SharedGpus())
        self.kv_tokens, self.chunk, self.step_tokens = probe.kv_tokens, probe.chunk, probe.step_tokens

    def replica(self, k: int, shared: SharedGpus):
        return sim_replica(f"r{k:02d}", self.spec, self.site.batching, self.timings, memory_bytes=self.memory_bytes,
                           block_tokens=BLOCK, gpus=((f"gpu{k}", 0),), shared=shared)  # a GPU of its own

    def describe(self) -> str:
        s = self.spec
        return (f"{self.replicas} replicas of {self.model} ({s.architecture or 'no architecture: scaled 8B'}, "
                f"TP{s.tensor_parallel} PP{s.pipeline_parallel}, max_seq_len {s.max_seq_len}) on {self.gpu}, "
                f"a GPU each: max batch {s.max_batch_size}, "
                f"chunk {self.chunk}, {self.step_tokens} tokens a step, {self.kv_tokens} KV tokens each; "
                f"router {self.site.router.model_dump(include={'block_size', 'prefix_mode', 'max_load_factor'})}, "
                f"stats every {self.site.router.replica_heartbeat:g}s")


def usable(rows: list[Row], fleet: Fleet) -> tuple[list[Row], int]:
    """The rows a replica can serve, and how many were skipped (longer than max_seq_len or the KV pool)."""
    limit = min(fleet.spec.max_seq_len, fleet.kv_tokens)
    kept = [r for r in rows if r.input_length + max(1, r.output_length) <= limit]
    return kept, len(rows) - len(kept)


def make_dispatcher(fleet: Fleet, policy_name: str, seed: int) -> Dispatcher:
    """The router a site with ``router.policy: policy_name`` runs (from_site), its random draws from ``seed``."""
    site = fleet.site
    router = site.router.model_copy(update={"policy": policy_name})
    policy = policy_class(policy_name).from_site(router, site.batching)
    for owner in (policy, getattr(policy, "balance", None)):
        for name in ("rng", "_rng"):
            if hasattr(owner, name):
                getattr(owner, name).seed(seed)
    return Dispatcher(policy, dispatch_settings(site), {fleet.model})


def replay(rows: list[Row], policy_name: str, fleet: Fleet, scale: float, seed: int = 0) -> dict:
    """Replay ``rows`` with arrival times divided by ``scale``; the policy's TTFTs, queues and hit rate."""
    shared = SharedGpus()
    ids = [f"r{i:02d}" for i in range(fleet.replicas)]
    engines = {rid: fleet.replica(k, shared) for k, rid in enumerate(ids)}
    d = make_dispatcher(fleet, policy_name, seed)
    precise = d.follows_kv_events
    hasher = getattr(d.policy, "hasher", None) if d.policy.uses_prefix else None
    sub = max(1, BLOCK // hasher.block_size) if hasher is not None else 1
    order = random.Random(seed).sample(ids, len(ids))  # replicas register in no set order in a real job
    for rid in order:
        r = engines[rid]
        if precise:
            r.kv_log = []
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model=fleet.model, pid=0,
                                               max_batch_size=r.max_batch, max_seq_len=fleet.spec.max_seq_len), 0.0)
    heartbeat = fleet.site.router.replica_heartbeat
    phases = random.Random(seed)
    next_stats = {rid: phases.uniform(0, heartbeat) for rid in ids}  # real replicas report unsynchronised
    queues: list[tuple[float, int]] = []  # (fleet mean, max) at every report while requests arrive
    backlog: list[tuple[float, int]] = []  # (time, requests the fleet holds before their first token)
    queued = dict.fromkeys(ids, 0)
    arrivals: dict[str, float] = {}
    first: dict[str, float] = {}
    sent: dict[str, SimSeq] = {}
    done = i = 0
    now = 0.0
    sample_at = tick_at = 0.0

    failed = 0

    def deliver(out, now: float) -> None:
        nonlocal done, failed
        for o in out:
            m = o.message
            if o.side == REPLICA:
                if isinstance(m, GenerateRequest):  # a resend carries its attempt's id
                    seq = sent[request_id_of(m.request_id)]
                    engines[o.peer.decode()].add(SimSeq(m.request_id, seq.prompt, seq.max_tokens, seq.blocks), now)
                elif isinstance(m, Abort):  # the router moved it (a stalled stream, a first token too late)
                    engines[o.peer.decode()].abort(m.request_id)
            elif isinstance(m, TokenChunk):
                if m.request_id not in first:
                    first[m.request_id] = now
                done += m.finished
            elif isinstance(m, RequestError):
                failed += 1
                done += 1

    def depth(r) -> int:  # requests not yet at their first token: waiting, or admitted and in prefill
        return len(r.waiting) + len(r.prefilling)

    while done < len(rows):
        t_arrival = rows[i].arrival / scale if i < len(rows) else float("inf")
        t_engine, busy = float("inf"), None
        for rid, r in engines.items():
            if r.busy and r.busy_until < t_engine:
                t_engine, busy = r.busy_until, rid
        stats_rid = min(next_stats, key=next_stats.get)
        t_stats = min(next_stats[stats_rid], sample_at, tick_at)
        now = max(now, min(t_arrival, t_engine, t_stats))
        if t_stats <= t_arrival and t_stats <= t_engine:
            if tick_at <= t_stats:  # the router's housekeeping, once a second as it runs: timeouts move requests
                deliver(d.tick(now), now)
                tick_at = now + 1.0
                continue
            if sample_at <= next_stats[stats_rid]:  # the bench's own sample of the fleet's queues
                depths = [depth(r) for r in engines.values()]
                backlog.append((now, sum(depths)))
                if i < len(rows):
                    queues.append((sum(depths) / len(depths), max(depths)))
                    for rid, n in zip(ids, depths):
                        queued[rid] += n
                sample_at = now + heartbeat / 10
                continue
            r = engines[stats_rid]
            deliver(d.on_replica_message(stats_rid, ReplicaStats(
                replica_id=stats_rid, queue_depth=len(r.waiting), running=len(r.prefilling) + r.n_decoding,
                kv_used=r.used / r.kv_tokens, latency_ewma_ms=r.latency_ewma_ms), now), now)
            next_stats[stats_rid] = now + heartbeat
        elif t_arrival <= t_engine:
            row = rows[i]
            rid = f"q{i}"
            blocks = tuple(row.hash_ids)
            sent[rid] = SimSeq(rid, row.input_length, max(1, row.output_length), blocks)
            arrivals[rid] = now
            req = simulated_request(rid, i, fleet.model, row.input_length, max(1, row.output_length), blocks,
                                    BLOCK, hasher)
            deliver(d.on_request(b"gw", req, now), now)
            i += 1
        else:
            r = engines[busy]
            for kind, seq in r.wake(now):  # progress too: the router takes a silent stream as stalled
                chunk = TokenChunk(request_id=seq.request_id, token_ids=[0] * (seq.progress if kind == "progress" else 1),
                                   finished=kind == "done", finish_reason="length" if kind == "done" else None)
                deliver(d.on_replica_message(busy, chunk, now), now)
            if precise and r.kv_log:
                d.on_kv_events(busy, kv_events_of(r.kv_log, sub, hasher.block_size))
                r.kv_log.clear()
    makespan = now
    ttft = sorted(first[q] - arrivals[q] for q in first)
    hit_tokens = sum(r.hit_tokens for r in engines.values())
    blocks = sum(len(r.hash_ids) for r in rows)
    peak = max(queues, key=lambda q: (q[1], -q[0]), default=(0.0, 0))
    return {
        "policy": policy_name, "seed": seed, "requests": len(rows), "completed": d.counters["completed"],
        "failed": failed, "retries": d.counters["retries"],
        "block_hit_rate": hit_tokens / BLOCK / blocks,
        "ttft_mean": statistics.fmean(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "queue_max": peak[1], "queue_mean_at_max": peak[0],
        "queue_mean": statistics.fmean(q[0] for q in queues) if queues else 0.0,
        "queue_max_mean": statistics.fmean(q[1] for q in queues) if queues else 0.0,
        # a hot spot: the replica whose queue was longest on average, against the fleet's average
        "queue_hot": max(queued.values()) / max(1e-9, statistics.fmean(queued.values())),
        "queue_over_3x": sum(q[1] > 3 * q[0] and q[1] > 1 for q in queues) / len(queues) if queues else 0.0,
        "utilisation": shared.work_s / (fleet.replicas * makespan),
        "makespan": makespan, "busy_seconds": shared.work_s,
        "routing": dict(d.reasons),
        "last_arrival": rows[-1].arrival / scale, "last_first_token": max(first.values()), "backlog": backlog,
    }


def idle_prefill_seconds(timings, uncached: int, cached: int, chunk: int) -> float:
    """Prefill of ``uncached`` tokens after ``cached`` ones on an idle replica, chunk by chunk."""
    t, done = 0.0, cached
    while uncached > 0:
        n = min(chunk, uncached)
        t += (timings.step_overhead_s + timings.prefill_per_token_s * n
              + timings.prefill_per_pair_s * (n * done + n * (n + 1) // 2))
        uncached, done = uncached - n, done + n
    return t


def ttft_bound(rows: list[Row], fleet: Fleet) -> dict:
    """What no router can beat: each request alone on an idle replica that holds every block ever seen.

    Mean TTFT is then the prefill of the prompt's never-seen suffix (the
    final token is always computed), with no queueing and no decode sharing
    the steps; the block hit rate is that of one infinite cache (36.6% for
    the Mooncake conversation trace).
    """
    timings, seen, chunk = fleet.timings, set(), min(fleet.chunk, fleet.step_tokens)
    ttft, hit, blocks = [], 0, 0
    for row in rows:
        k = 0
        while k < len(row.hash_ids) and row.hash_ids[k] in seen:
            k += 1
        cached = min(k * BLOCK, row.input_length - 1)
        ttft.append(idle_prefill_seconds(timings, row.input_length - cached, cached, chunk))
        hit, blocks = hit + k, blocks + len(row.hash_ids)
        seen.update(row.hash_ids)
    ttft.sort()
    return {"block_hit_rate": hit / blocks, "ttft_mean": statistics.fmean(ttft),
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))]}


def backlog_quarters(r: dict, first_arrival: float) -> tuple[float, float]:
    """The fleet's mean backlog over the second and over the last quarter of the arrival window
    (the first quarter is warm-up)."""
    t0, t1 = first_arrival, r["last_arrival"]
    span = t1 - t0

    def mean(a: float, b: float) -> float:
        qs = [q for t, q in r["backlog"] if t0 + a * span <= t < t0 + b * span]
        return statistics.fmean(qs) if qs else 0.0
    return mean(0.25, 0.5), mean(0.75, 1.0)


def offered_rate(rows: list[Row]) -> float:
    """The trace's own arrival rate, requests/s."""
    return len(rows) / max(1e-9, rows[-1].arrival - rows[0].arrival)


def measure_capacity(rows: list[Row], fleet: Fleet, tolerance: float = 0.01, log=print) -> tuple[float, list[dict]]:
    """The fleet's capacity in requests/s: the highest arrival rate at which it keeps up with this trace.

    The trace is replayed under token-aware least-load (the best simple baseline) with its times
    scaled; a rate is *sustained* when the backlog (requests waiting or in prefill, not yet at their
    first token, summed over the fleet) does not grow while requests arrive: its mean over the last
    quarter of the arrival window exceeds its mean over the second quarter by at most one request per
    replica. One criterion, and a growing backlog fails it: past capacity the backlog grows by
    (rate - capacity) x time without bound, so over the ~half window between those quarters an excess
    of a few % of capacity on a few thousand requests is seen, while a stable queue's backlog
    fluctuates about its level. (An earlier second clause, "or it has not doubled", let a fleet whose
    backlog grew by half pass.) The first probe is a guess (the rows all arriving at once: requests x
    replicas / GPU-busy seconds); the rate then steps by x1.25 until one end is sustained and the other
    not, and a bisection (geometric) narrows that bracket to ``tolerance``; the capacity is its
    sustained end. Returns the capacity and every probe (rate, sustained, backlog, mean TTFT).
    """
    if not rows:
        raise ValueError("no requests to measure the capacity on")
    base, first = offered_rate(rows), rows[0].arrival
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        scale = rate / base
        r = replay(rows, "least_tokens", fleet, scale)
        early, late = backlog_quarters(r, first / scale)
        p = {"rate": rate, "sustained": late - early <= fleet.replicas, "backlog": (early, late),
             "ttft_mean": r["ttft_mean"], "queue_max": r["queue_max"]}
        probes.append(p)
        log(f"  {rate:6.2f} requests/s: backlog {early:5.1f} -> {late:5.1f} over the arrivals, "
            f"{'sustained' if p['sustained'] else 'NOT sustained'} (least_tokens TTFT mean {r['ttft_mean']:.2f}s, "
            f"longest replica queue {r['queue_max']})")
        return p["sustained"]

    guess = replay(rows, "least_tokens", fleet, 1000.0)
    rate = len(rows) * fleet.replicas / guess["busy_seconds"]
    if probe(rate):
        lo = rate
        while probe(lo * 1.25):
            lo *= 1.25
        hi = lo * 1.25
    else:
        hi = rate
        while not probe(hi / 1.25):
            hi /= 1.25
        lo = hi / 1.25
    while hi / lo > 1 + tolerance:
        mid = (lo * hi) ** 0.5
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def time_scale(rows: list[Row], capacity: float, target: float) -> float:
    """Divide the trace's times by this to offer ``target`` x ``capacity`` requests/s."""
    return target * capacity / offered_rate(rows)


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else ""


def summarise(runs: list[dict]) -> dict:
    """The mean over seeds of each figure, with the range of the TTFTs."""
    keys = ("block_hit_rate", "ttft_mean", "ttft_p99", "utilisation", "queue_mean", "queue_max_mean", "queue_hot",
            "queue_over_3x")
    out = {k: statistics.fmean(r[k] for r in runs) for k in keys}
    out["ttft_mean_range"] = (min(r["ttft_mean"] for r in runs), max(r["ttft_mean"] for r in runs))
    out["ttft_p99_range"] = (min(r["ttft_p99"] for r in runs), max(r["ttft_p99"] for r in runs))
    out["routing"] = runs[0]["routing"]
    out["retries"] = statistics.fmean(r["retries"] for r in runs)
    out["failed"] = statistics.fmean(r["failed"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace (default: the conversation "
                        "trace); 'tenant' generates benchmarks/tenant_trace.py's (4,000 requests, seed 7)")
    parser.add_argument("--site", default=str(SITE), help="the site whose router, batching and model are deployed")
    parser.add_argument("--model", default=None, help="the site's model the replicas serve (default: its first)")
    parser.add_argument("--gpu", default=None, choices=sorted(GPU_SPECS),
                        help="the replicas' GPU (default: the site's cluster.gpu_kind)")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.70, 0.85, 0.95])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="each load is replayed once per seed (the replicas' report phases, the policies' draws)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the model's max_seq_len as the site would set it (default: the site's); longer "
                             "requests are skipped, as its gateway refuses them")
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s the loads are fractions of (default: measured, see measure_capacity)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    args = parser.parse_args(argv)
    logging.getLogger("exaserve_hpc").setLevel(logging.ERROR)  # breakers opening under load: counted, not logged
    site = load_site(args.site)
    model = args.model or site.models[0].model_name
    gpu = args.gpu or site.cluster.gpu_kind
    if gpu not in GPU_SPECS:
        parser.error(f"the site's GPU kind {gpu!r} has no datasheet entry; give --gpu, one of {', '.join(sorted(GPU_SPECS))}")
    fleet = Fleet(site, model, gpu, args.replicas, args.max_seq_len)
    if args.trace == "tenant":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tenant_trace import generate  # a sibling script, not a package module
        raw = generate(4000, 300, 7)
        rows = [Row(r["timestamp"] / 1000.0, r["input_length"], r["output_length"], r["hash_ids"]) for r in raw]
        rows = rows[:args.limit] if args.limit else rows
    else:
        rows = load_trace(Path(args.trace), args.limit)
    rows, skipped = usable(rows, fleet)
    print(f"{len(rows)} requests of {args.trace} ({skipped} skipped: longer than max_seq_len or the KV pool); "
          f"{fleet.describe()}", flush=True)
    bound = ttft_bound(rows, fleet)
    print(f"lower bound (every request alone on an idle replica holding every block seen before): "
          f"hit rate {bound['block_hit_rate']:.1%}, TTFT mean {bound['ttft_mean']:.3f}s, "
          f"p90 {bound['ttft_p90']:.3f}s", flush=True)
    started = time.perf_counter()
    if args.capacity:
        capacity = args.capacity
        print(f"capacity given: {capacity:.2f} requests/s", flush=True)
    else:
        print(f"capacity: the highest arrival rate (the trace time-scaled; its own is {offered_rate(rows):.2f} "
              f"requests/s) at which least_tokens' backlog (requests before their first token, fleet-wide) "
              f"grows from the 2nd to the 4th quarter of the arrivals by at most {args.replicas} (one a replica); "
              f"steps of x1.25 from a saturation guess, then bisection to 1%:", flush=True)
        capacity, _ = measure_capacity(rows, fleet, log=lambda m: print(m, flush=True))
        print(f"measured capacity: {capacity:.2f} requests/s ({time.perf_counter() - started:.0f}s)", flush=True)
    results, table = [], {}
    for load in args.loads:
        scale = time_scale(rows, capacity, load)
        print(f"\nload {load:.0%} of capacity: {load * capacity:.2f} requests/s, time scale x{scale:.3f}, "
              f"seeds {' '.join(map(str, args.seeds))}", flush=True)
        print(f"{'policy':<19} {'hit rate':>8} {'TTFT mean':>10} {'(range)':>13} {'p99':>8} {'(range)':>13} "
              f"{'/bound':>7} {'util':>6} {'queue':>6} {'max':>5} {'hot':>5} {'>3x':>6} {'moved':>5} {'failed':>6}  routing")
        for name in args.policies:
            t0 = time.perf_counter()
            runs = []
            for seed in args.seeds:
                r = replay(rows, name, fleet, scale, seed)
                del r["backlog"]  # the series behind measure_capacity, not a result
                r.update(load=load, scale=scale, capacity=capacity, skipped=skipped,
                         bound_ttft_mean=bound["ttft_mean"], bound_hit_rate=bound["block_hit_rate"])
                runs.append(r)
            results += runs
            m = table[load, name] = summarise(runs)
            print(f"{name:<19} {m['block_hit_rate']:>8.1%} {m['ttft_mean']:>9.3f}s {spread([r['ttft_mean'] for r in runs]):>13} "
                  f"{m['ttft_p99']:>7.2f}s {spread([r['ttft_p99'] for r in runs]):>13} "
                  f"{m['ttft_mean'] / bound['ttft_mean']:>6.2f}x {m['utilisation']:>6.1%} {m['queue_mean']:>6.1f} "
                  f"{m['queue_max_mean']:>5.1f} {m['queue_hot']:>4.1f}x {m['queue_over_3x']:>6.1%} {m['retries']:>5.0f} {m['failed']:>6.0f}"
                  f"  {m['routing'] or ''}  ({time.perf_counter() - t0:.0f}s)", flush=True)
        ours = table.get((load, "prefix_affinity"))
        field = {n: table[load, n] for n in FIELD if (load, n) in table}
        if ours and field:
            best = min(field, key=lambda n: field[n]["ttft_mean"])
            print(f"prefix_affinity: mean TTFT {ours['ttft_mean'] / field[best]['ttft_mean']:.2f}x the best field "
                  f"router's ({best}), p99 {ours['ttft_p99'] / min(f['ttft_p99'] for f in field.values()):.2f}x the "
                  f"field's lowest"
                  + (f", {ours['ttft_mean'] / table[load, 'least_tokens']['ttft_mean']:.2f}x least_tokens"
                     if (load, "least_tokens") in table else "")
                  + f"; {ours['ttft_mean'] / bound['ttft_mean']:.2f}x the lower bound", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
