"""Replay a conversation trace against simulated replicas with several routing policies.

    python benchmarks/bench_router_trace.py [--gpu h200] [--replicas 16] [--loads 0.70 0.85 0.95]
        [--limit N] [--trace FILE] [--policies ...] [--capacity R] [--max-load-factors F ...]

Each replica is a timing-model engine (`engine/timing.py`: the reference
engine's scheduler and block manager, prefix cache included, with step time
from a Llama-3-8B roofline of the GPU's datasheet, `engine/gpu_specs.py`),
scheduled as vLLM does: at most 8,192 tokens a step, decodes first, then
prefill chunks first come first served (so short prompts queue behind long
ones); KV pool sized like the GPU's memory less 16 GB of weights. All run on
one virtual clock. Requests go through the real `Dispatcher` (the router's
bookkeeping, not a re-implementation); replicas report stats every 100 ms of
virtual time, like the real ones. Prefix affinity's cost constants come from
the same timing model (`AffinitySettings.from_timings`), not from tuning.

Prompts: the trace gives 512-token block hash ids, so block h becomes the
token ids h*512 .. h*512+511 (two requests that share a hash id share those
tokens, and so the engine's own chained block hashes) and the engine and the
router both use 512-token blocks. Requests longer than ``--max-seq`` (prompt
+ output) or than a replica's KV pool are skipped and counted.

Load: the fleet's capacity is measured first, on the same requests: the
highest arrival rate (the trace's times scaled) at which token-aware
least-load keeps up, i.e. the fleet's backlog of requests before their first
token does not grow while they arrive (`measure_capacity`: a bracket, then a
bisection to 1%; every probe is printed; ``--capacity R`` gives it instead,
e.g. 19.06 for ``--limit 3000`` on 16 H200s, and skips the minutes that takes). Each load level then replays the
trace scaled to that fraction of the capacity. Reported per policy: block
hit rate, mean and p99 TTFT, utilisation (GPU-busy time: a replica decoding
a few sequences counts as busy), preemptions, replica queues (requests
waiting or in prefill: not yet at their first token) sampled at every stats
report while the trace arrives (the fleet's mean, the longest queue's mean,
the peak with the fleet's mean at that moment, and "hot": the replica whose
queue was longest on average against the fleet's average; ">3x": the share of
reports at which some replica's queue was above 3x the fleet's mean and above
1), skipped requests. Also a lower bound no router can
beat (`ttft_bound`: every request alone on an idle replica that holds every
block seen before). ``--max-load-factors F ...`` runs prefix affinity once per
bounded-load factor (``router.max_load_factor``, 0: no cap), each shown as
prefix_affinity@F, so the cap's cost and its queues sit side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, TimingEngine, timings_for
from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, ReplicaStats, TokenChunk
from exaserve_hpc.router.affinity import AffinitySettings
from exaserve_hpc.router.policies import make_policy
from exaserve_hpc.router.dispatch import GATEWAY, REPLICA, Dispatcher, DispatchSettings

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 512
GPU_MEMORY_GB = {"h100-sxm": 80, "h200": 141, "a100-80gb": 80, "gh200": 96}
WEIGHTS_GB = 16  # an 8B-parameter model in fp16


def kv_blocks_for(gpu: str) -> int:
    """KV blocks of 512 tokens that fit beside the weights (128 KiB of K/V per token)."""
    return int((GPU_MEMORY_GB[gpu] - WEIGHTS_GB) * 1e9 / (131072 * BLOCK))
MAX_SEQ = 131072
STATS_EVERY = 0.1
STEP_TOKENS = DEFAULT_MAX_NUM_BATCHED_TOKENS  # vLLM's per-step budget; a chunk may take all of it, as in vLLM
MAX_BATCH = 128
POLICIES = ["round_robin", "least_load", "least_tokens", "power_of_two", "prefix_affinity"]


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


def prompt_tokens(row: Row) -> list[int]:
    tokens: list[int] = []
    for h in row.hash_ids:
        base = h * BLOCK
        tokens.extend(range(base, base + BLOCK))
    return tokens[:row.input_length]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def usable(rows: list[Row], gpu: str, max_seq: int) -> tuple[list[Row], int]:
    """The rows a replica can serve, and how many were skipped (too long for max_seq or the KV pool)."""
    limit = min(max_seq, kv_blocks_for(gpu) * BLOCK)
    kept = [r for r in rows if r.input_length + max(1, r.output_length) <= limit]
    return kept, len(rows) - len(kept)


def make_dispatcher(policy_name: str, seed: int, gpu: str, rows: list[Row],
                    max_load_factor: float | None = None) -> Dispatcher:
    if policy_name == "prefix_affinity":
        context = statistics.fmean(r.input_length + r.output_length / 2 for r in rows)
        bounded = {} if max_load_factor is None else {"max_load_factor": max_load_factor}  # None: the default
        settings = AffinitySettings.from_timings(timings_for(gpu), STEP_TOKENS, context, block_size=BLOCK,
                                                 max_prompt_blocks=512, **bounded)
        policy = make_policy(policy_name, settings=settings, seed=seed)
    elif policy_name == "power_of_two":
        policy = make_policy(policy_name, seed=seed)
    else:
        policy = make_policy(policy_name)
    settings = DispatchSettings(max_attempts=3, request_timeout=1e9, first_token_timeout=1e9, replica_expiry=1e9)
    return Dispatcher(policy, settings, {"m"})


def replay(rows: list[Row], policy_name: str, replicas: int, scale: float, seed: int = 0,
           gpu: str = "h100-sxm", max_load_factor: float | None = None) -> dict:
    clock = Clock()
    engines = {f"r{i:02d}": TimingEngine(gpu_kind=gpu, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ,
                                         max_wait_ms=0, block_size=BLOCK, num_kv_blocks=kv_blocks_for(gpu),
                                         vocab_size=2 ** 31 - 1, clock=clock, prefill_chunk_tokens=STEP_TOKENS,
                                         max_num_batched_tokens=STEP_TOKENS, prefill_batch_size=MAX_BATCH)
               for i in range(replicas)}
    d = make_dispatcher(policy_name, seed, gpu, rows, max_load_factor)
    for rid in engines:
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=0, max_batch_size=MAX_BATCH,
                                               max_seq_len=MAX_SEQ), 0.0)
    queues: list[tuple[float, int]] = []  # (fleet mean, max) at every stats report while requests wait
    backlog: list[tuple[float, int]] = []  # (time, requests the fleet holds before their first token), every report
    queued = dict.fromkeys(engines, 0)  # each replica's queue summed over the reports while the trace arrives
    arrivals = {f"q{i}": row.arrival / scale for i, row in enumerate(rows)}
    first: dict[str, float] = {}
    done = 0
    next_stats = 0.0
    i = 0

    def deliver(out) -> None:
        for o in out:
            if o.side == REPLICA and isinstance(o.message, GenerateRequest):
                m = o.message
                engines[o.peer.decode()].add_request(EngineRequest(
                    request_id=m.request_id, prompt_token_ids=m.prompt_token_ids, max_tokens=m.max_tokens))
            elif o.side == GATEWAY and isinstance(o.message, TokenChunk) and o.message.request_id not in first:
                first[o.message.request_id] = clock.now

    while done < len(rows):
        t_arrival = rows[i].arrival / scale if i < len(rows) else float("inf")
        t_engine, busy = float("inf"), None
        for rid, engine in engines.items():
            t = engine.next_event_time()
            if t is not None and t < t_engine:
                t_engine, busy = t, rid
        t_next = min(t_arrival, t_engine, next_stats)
        clock.now = max(clock.now, t_next)
        if t_next == next_stats:
            depths = []
            for rid, engine in engines.items():
                s = engine.stats()
                # The queue a TTFT waits in: requests not yet admitted, and admitted ones still in prefill
                # (under a token budget a running prompt can wait steps for its chunks).
                depths.append(s["queue_depth"] + sum(q.first_token_at is None for q in engine.scheduler.running))
                d.on_replica_message(rid, ReplicaStats(replica_id=rid, queue_depth=s["queue_depth"],
                                                       running=s["running"], kv_used=s["kv_used"]), clock.now)
            backlog.append((clock.now, sum(depths)))
            if i < len(rows):  # while the trace is still arriving (not the drain at its end)
                queues.append((sum(depths) / len(depths), max(depths)))
                for rid, depth in zip(engines, depths):
                    queued[rid] += depth
            next_stats = clock.now + STATS_EVERY
        elif t_next == t_arrival:
            row = rows[i]
            req = GenerateRequest(request_id=f"q{i}", model="m", prompt_token_ids=prompt_tokens(row),
                                  max_tokens=max(1, row.output_length))
            deliver(d.on_request(b"gw", req, clock.now))
            i += 1
        else:
            engine = engines[busy]
            for out in engine.step():
                if out.finished or out.request_id not in first:
                    chunk = TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids[:1],
                                       finished=out.finished, finish_reason=out.finish_reason)
                    deliver(d.on_replica_message(busy, chunk, clock.now))
                    done += out.finished
    makespan = clock.now
    ttft = sorted(first[r] - arrivals[r] for r in first)
    hit_tokens = sum(e.blocks.prefix_hit_tokens for e in engines.values())
    blocks = sum(len(r.hash_ids) for r in rows)
    busy = sum(e.busy_seconds for e in engines.values())
    peak = max(queues, key=lambda q: (q[1], -q[0]), default=(0.0, 0))
    return {
        "policy": policy_name, "requests": len(rows), "completed": d.counters["completed"],
        "block_hit_rate": hit_tokens / BLOCK / blocks,
        "ttft_mean": statistics.fmean(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "queue_max": peak[1], "queue_mean_at_max": peak[0],
        "queue_mean": statistics.fmean(q[0] for q in queues) if queues else 0.0,
        "queue_max_mean": statistics.fmean(q[1] for q in queues) if queues else 0.0,
        # a hot spot: the replica whose queue was longest on average, against the fleet's average
        "queue_hot": max(queued.values()) / max(1e-9, statistics.fmean(queued.values())),
        # reports at which some replica's queue was above 3x the fleet's mean (and above 1: one request
        # waiting where the fleet holds a fraction of one a replica is no hot spot), the hot-spot test
        "queue_over_3x": sum(q[1] > 3 * q[0] and q[1] > 1 for q in queues) / len(queues) if queues else 0.0,
        "utilisation": busy / (replicas * makespan),
        "preemptions": sum(e.scheduler.preemptions for e in engines.values()),
        "makespan": makespan, "busy_seconds": busy,
        "routing": dict(d.reasons),
        "last_arrival": rows[-1].arrival / scale, "last_first_token": max(first.values()), "backlog": backlog,
    }


def idle_prefill_seconds(timings, uncached: int, cached: int, chunk: int = STEP_TOKENS) -> float:
    """Prefill of ``uncached`` tokens after ``cached`` ones on an idle replica, chunk by chunk."""
    t, done = 0.0, cached
    while uncached > 0:
        n = min(chunk, uncached)
        t += (timings.step_overhead_s + timings.prefill_per_token_s * n
              + timings.prefill_per_pair_s * (n * done + n * (n + 1) // 2))
        uncached, done = uncached - n, done + n
    return t


def ttft_bound(rows: list[Row], gpu: str) -> dict:
    """What no router can beat: each request alone on an idle replica that holds every block ever seen.

    Mean TTFT is then the prefill of the prompt's never-seen suffix (the
    final token is always computed), with no queueing and no decode sharing
    the steps; the block hit rate is that of one infinite cache (36.6% for
    the Mooncake conversation trace).
    """
    timings, seen = timings_for(gpu), set()
    ttft, hit, blocks = [], 0, 0
    for row in rows:
        k = 0
        while k < len(row.hash_ids) and row.hash_ids[k] in seen:
            k += 1
        cached = min(k * BLOCK, row.input_length - 1)
        ttft.append(idle_prefill_seconds(timings, row.input_length - cached, cached))
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


def measure_capacity(rows: list[Row], replicas: int, gpu: str, tolerance: float = 0.01,
                     log=print) -> tuple[float, list[dict]]:
    """The fleet's capacity in requests/s: the highest arrival rate at which it keeps up with this trace.

    The trace is replayed under token-aware least-load (the best simple baseline) with its times
    scaled; a rate is *sustained* when the backlog (requests waiting or in prefill, not yet at their
    first token, summed over the fleet) does not grow while requests arrive: its mean over the last
    quarter of the arrival window exceeds its mean over the second quarter by at most one request
    per replica, or by at most that second-quarter mean (it has not doubled): a stable queue's
    backlog fluctuates about its level, bursts included, while past capacity it grows by
    (rate - capacity) x time without bound, so over the ~half window between those quarters this
    detects an excess of a few % of capacity on a few thousand
    requests. The first probe is a cheap guess (the rows all arriving at once: requests x replicas /
    GPU-busy seconds); the rate then steps by x1.25 until one end is sustained and the other not,
    and a bisection (geometric) narrows that bracket to ``tolerance``; the capacity is its sustained
    end. (Probes stay near capacity: a replay far below it is slow, a decode step every few ms.)

    That guess is not the capacity: all arriving at once, no conversation turn could reuse the KV of
    its previous turn and every step was full, while at any real rate a replica decoding a handful
    of sequences counts as busy as a full one; loads labelled against it were ~80% of this.
    Returns the capacity and every probe (rate, sustained, backlog in those quarters, mean TTFT).
    """
    if not rows:
        raise ValueError("no requests to measure the capacity on")
    base, first = offered_rate(rows), rows[0].arrival
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        scale = rate / base
        r = replay(rows, "least_tokens", replicas, scale, gpu=gpu)
        early, late = backlog_quarters(r, first / scale)
        p = {"rate": rate, "sustained": late - early <= max(replicas, early), "backlog": (early, late),
             "ttft_mean": r["ttft_mean"], "queue_max": r["queue_max"]}
        probes.append(p)
        log(f"  {rate:6.2f} requests/s: backlog {early:5.1f} -> {late:5.1f} over the arrivals, "
            f"{'sustained' if p['sustained'] else 'NOT sustained'} (least_tokens TTFT mean {r['ttft_mean']:.2f}s, "
            f"longest replica queue {r['queue_max']})")
        return p["sustained"]

    guess = replay(rows, "least_tokens", replicas, 1000.0, gpu=gpu)
    rate = len(rows) * replicas / guess["busy_seconds"]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.70, 0.85, 0.95])
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--max-seq", type=int, default=MAX_SEQ, help="longer requests (prompt + output) are skipped")
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s the loads are fractions of (default: measured, see measure_capacity)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPU_MEMORY_GB),
                        help="timing constants and KV pool size of each replica")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--max-load-factors", type=float, nargs="+", default=None, metavar="F",
                        help="run prefix_affinity once per bounded-load factor F (router.max_load_factor; 0: no "
                             "cap), each shown as prefix_affinity@F (default: once, at the setting's default)")
    args = parser.parse_args(argv)
    runs = [(name, None) for name in args.policies if name != "prefix_affinity" or not args.max_load_factors]
    if "prefix_affinity" in args.policies and args.max_load_factors:
        runs += [("prefix_affinity", f) for f in args.max_load_factors]
    rows, skipped = usable(load_trace(Path(args.trace), args.limit), args.gpu, args.max_seq)
    print(f"{len(rows)} requests ({skipped} skipped: longer than {args.max_seq} tokens or the KV pool), "
          f"{args.replicas} replicas ({args.gpu} timing model {timings_for(args.gpu)}), "
          f"{kv_blocks_for(args.gpu)} KV blocks of {BLOCK} tokens each, {STEP_TOKENS} tokens a step", flush=True)
    bound = ttft_bound(rows, args.gpu)
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
              f"grows from the 2nd to the 4th quarter of the arrivals by at most {args.replicas} (one a replica) or by at most its 2nd-quarter level; "
              f"steps of x1.25 from a saturation guess, then bisection to 1%:", flush=True)
        capacity, _ = measure_capacity(rows, args.replicas, args.gpu, log=lambda m: print(m, flush=True))
        print(f"measured capacity: {capacity:.2f} requests/s ({time.perf_counter() - started:.0f}s)", flush=True)
    results = []
    for load in args.loads:
        scale = time_scale(rows, capacity, load)
        print(f"\nload {load:.0%} of capacity: {load * capacity:.1f} requests/s, time scale x{scale:.2f}", flush=True)
        print(f"{'policy':<19} {'hit rate':>8} {'TTFT mean':>10} {'p99':>8} {'/bound':>7} {'util':>6} "
              f"{'preempt':>7} {'queue mean':>10} {'max(avg)':>8} {'peak@mean':>10} {'hot':>5} {'>3x':>6}  routing")
        for name, factor in runs:
            started = time.perf_counter()
            r = replay(rows, name, args.replicas, scale, gpu=args.gpu, max_load_factor=factor)
            del r["backlog"]  # the series behind measure_capacity, not a result
            label = name if factor is None else f"{name}@{factor:g}"
            if factor is not None:
                r.update(policy=label, max_load_factor=factor)
            r.update(load=load, scale=scale, capacity=capacity, skipped=skipped, wall_s=time.perf_counter() - started,
                     bound_ttft_mean=bound["ttft_mean"], bound_hit_rate=bound["block_hit_rate"])
            results.append(r)
            print(f"{label:<19} {r['block_hit_rate']:>8.1%} {r['ttft_mean']:>9.3f}s {r['ttft_p99']:>7.2f}s "
                  f"{r['ttft_mean'] / bound['ttft_mean']:>6.2f}x {r['utilisation']:>6.1%} {r['preemptions']:>7} "
                  f"{r['queue_mean']:>10.1f} {r['queue_max_mean']:>8.1f} {r['queue_max']:>4}@{r['queue_mean_at_max']:<5.1f} {r['queue_hot']:>4.1f}x {r['queue_over_3x']:>6.1%}"
                  f"  {r['routing'] or ''}  ({r['wall_s']:.0f}s)", flush=True)
        by = {r["policy"]: r for r in results if r["load"] == load}
        for label, a in by.items() if "least_tokens" in by else ():
            if not label.startswith("prefix_affinity"):
                continue
            print(f"{label} TTFT: {a['ttft_mean'] / by['least_tokens']['ttft_mean']:.2f}x least_tokens, "
                  + (f"{a['ttft_mean'] / by['round_robin']['ttft_mean']:.2f}x round-robin, " if "round_robin" in by else "")
                  + f"{a['ttft_mean'] / bound['ttft_mean']:.2f}x the lower bound; hit rate "
                  f"{a['block_hit_rate'] / bound['block_hit_rate']:.0%} of the {bound['block_hit_rate']:.1%} "
                  f"an infinite cache reaches", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
